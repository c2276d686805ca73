"""Every operator has an autograd registration: the split stages are
differentiable to any order (gradcheck and gradgradcheck in float64), and
backpropagating through them raises no warning that no autograd kernel is
registered."""

from __future__ import annotations

import warnings

import pytest
import torch

from torch_bn_grad import stages

OPS = torch.ops.torch_bn_grad
LAYOUTS = [("NCX", (3, 2, 4)), ("NXC", (3, 4, 2)), ("NCX", (5, 3)), ("NCX", (2, 2, 2, 3))]


def _inputs(data_format: str, shape: tuple[int, ...], dtype=torch.float64):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(shape, generator=g, dtype=torch.float64) * 2 + 0.5).to(dtype)
    dy = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    stats = stages.batch_norm_local_stats(x, data_format=data_format)
    count, mean, m2 = stats.unbind(0)
    var = m2 / count
    channels = count.shape[0]
    gamma = (torch.rand(channels, generator=g, dtype=torch.float64) + 0.5)
    gamma = gamma.to(torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype)
    sums = stages.batch_norm_grad_sums(x, dy, mean, data_format=data_format)
    return x, dy, mean.clone(), var.clone(), gamma, count.clone(), sums


def _leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().requires_grad_()


@pytest.mark.parametrize("data_format,shape", LAYOUTS, ids=str)
def test_local_stats_gradcheck(data_format, shape):
    x = _leaf(_inputs(data_format, shape)[0])
    fn = lambda s: stages.batch_norm_local_stats(s, data_format=data_format)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (x,))
    assert torch.autograd.gradgradcheck(fn, (x,))


@pytest.mark.parametrize("data_format,shape", LAYOUTS, ids=str)
def test_grad_sums_gradcheck(data_format, shape):
    x, dy, mean, *_ = _inputs(data_format, shape)
    args = tuple(_leaf(t) for t in (x, dy, mean))
    fn = lambda s, d, m: stages.batch_norm_grad_sums(s, d, m, data_format=data_format)  # noqa: E731
    assert torch.autograd.gradcheck(fn, args)
    assert torch.autograd.gradgradcheck(fn, args)


@pytest.mark.parametrize("with_gamma", [True, False], ids=["gamma", "no-gamma"])
@pytest.mark.parametrize("data_format,shape", LAYOUTS, ids=str)
def test_grad_input_gradcheck(data_format, shape, with_gamma):
    x, dy, mean, var, gamma, count, sums = _inputs(data_format, shape)
    args = [_leaf(t) for t in (x, dy, mean, var, gamma, count, sums)]
    if not with_gamma:
        args[4] = None

    def fn(s, d, m, v, g, c, gs):
        return stages.batch_norm_grad_input(s, d, m, v, g, c, gs, epsilon=1e-3, data_format=data_format)

    assert torch.autograd.gradcheck(fn, tuple(args))
    assert torch.autograd.gradgradcheck(fn, tuple(args))


def test_backward_through_stages_does_not_warn_and_matches_the_composition():
    """SyncBatchNorm's training backward written with the stages, differentiated
    once more, equals torch's batch norm double backward."""
    x, dy, *_ = _inputs("NCX", (4, 3, 5))
    x, dy = _leaf(x), _leaf(dy)
    weight = _leaf(torch.rand(3, dtype=torch.float64) + 0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        stats = stages.batch_norm_local_stats(x)
        count, mean, variance = stages.combine_stats(stats.unsqueeze(0))
        sums = stages.batch_norm_grad_sums(x, dy, mean)
        dx = stages.batch_norm_grad_input(x, dy, mean, variance, weight, count, sums, epsilon=1e-5)
        loss = (dx * torch.linspace(-1, 1, dx.numel(), dtype=torch.float64).view_as(dx)).sum()
        grads = torch.autograd.grad(loss, (x, dy, weight))

    xr, dyr, wr = (_leaf(t) for t in (x, dy, weight))
    y = torch.nn.functional.batch_norm(xr, None, None, wr, None, True, 0.0, 1e-5)
    (dxr,) = torch.autograd.grad(y, xr, dyr, create_graph=True)
    lossr = (dxr * torch.linspace(-1, 1, dxr.numel(), dtype=torch.float64).view_as(dxr)).sum()
    torch.testing.assert_close(dx, dxr)
    for got, want in zip(grads, torch.autograd.grad(lossr, (xr, dyr, wr))):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gradients_keep_input_dtypes(dtype):
    x, dy, mean, var, gamma, count, sums = _inputs("NCX", (4, 3, 5), dtype)
    x, dy, gamma = _leaf(x), _leaf(dy), _leaf(gamma)
    stages.batch_norm_local_stats(x).sum().backward()
    stages.batch_norm_grad_input(x, dy, mean, var, gamma, count, sums).sum().backward()
    assert x.grad.dtype == dtype and dy.grad.dtype == dtype and gamma.grad.dtype == gamma.dtype


def test_every_operator_has_an_autograd_kernel():
    names = ["batch_norm_forward", "batch_norm_backward", "batch_norm_local_stats", "batch_norm_grad_sums",
             "batch_norm_grad_input", "batch_norm_update_running_stats", "batch_norm_act_forward",
             "batch_norm_act_forward_sign_bits", "batch_norm_act_backward", "batch_norm_stats_affine",
             "batch_norm_masked_forward", "batch_norm_masked_backward", "batch_norm_masked_act_forward",
             "batch_norm_masked_act_backward"]
    schemas = {s.name.split("::")[1] for s in torch._C._jit_get_all_schemas() if s.name.startswith("torch_bn_grad::")}
    # The forward operator's derivatives are made of differentiable operators (CompositeImplicitAutograd).
    composite = {"batch_norm_forward_grad", "batch_norm_forward_jvp"}
    assert schemas == set(names) | composite, schemas
    for name in names:
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"torch_bn_grad::{name}", "Autograd"), name
    for name in composite:
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"torch_bn_grad::{name}", "CompositeImplicitAutograd")
