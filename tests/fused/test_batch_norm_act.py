"""The fused batch norm + residual + activation operators (batch_norm_act_*)
and ``functional.batch_norm_act``: accuracy against torch's unfused
composition in float64 (no worse than that composition run in the same
dtype), every activation, with and without a residual, training and frozen,
layouts and ranks 2 to 5; the memory-saving backward; gradcheck and
gradgradcheck; opcheck; errors; determinism (torch.compile and export:
tests/fused/test_batch_norm_act_compile.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import torch_bn_grad
from support.batch_norm_act_cases import ACTIVATIONS, EPS, INVERTIBLE, LAYOUTS, SLOPE, rounded_inputs, torch_activation
from support.isa_runs import runs_to_compare
from torch_bn_grad.functional import batch_norm_act


def _unfused(x, rm, rv, w, b, training, residual, activation):
    """torch's composition: F.batch_norm + add + activation."""
    z = F.batch_norm(x, rm, rv, w, b, training, 0.1, EPS)
    return torch_activation(z + residual if residual is not None else z, activation)


def _run(fn, x, r, dy, w, b, rm, rv, dtype, training):
    """Output, running stats and gradients (x, w, b, residual) of fn in `dtype` data."""
    pdtype = torch.float64 if dtype == torch.float64 else torch.float32
    xs = x.to(dtype).requires_grad_()
    rs = r.to(dtype).requires_grad_() if r is not None else None
    ws, bs = w.to(pdtype).requires_grad_(), b.to(pdtype).requires_grad_()
    rms, rvs = rm.to(pdtype).clone(), rv.to(pdtype).clone()
    y = fn(xs, rms, rvs, ws, bs, training, rs)
    wrt = [xs, ws, bs] + ([rs] if rs is not None else [])
    grads = torch.autograd.grad(y, wrt, dy.to(dtype))
    return [y, rms, rvs, *grads]


def _ulp(dtype, value):
    return torch.finfo(dtype).eps * max(value, torch.finfo(dtype).tiny)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16],
                         ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("training", [True, False], ids=["train", "frozen"])
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_accuracy_no_worse_than_unfused(activation, with_residual, training, layout, dtype):
    data = rounded_inputs(layout, dtype, with_residual)
    ours_fn = lambda x, rm, rv, w, b, t, r: batch_norm_act(  # noqa: E731
        x, rm, rv, w, b, t, residual=r, activation=activation, negative_slope=SLOPE)
    native_fn = lambda x, rm, rv, w, b, t, r: _unfused(x, rm, rv, w, b, t, r, activation)  # noqa: E731
    ref = _run(native_fn, *data, torch.float64, training)
    ours = _run(ours_fn, *data, dtype, training)
    assert ours[0].dtype == dtype and ours[0].is_contiguous(memory_format=LAYOUTS[layout][1])
    names = ["dst", "running_mean", "running_var", "diff_src", "diff_gamma", "diff_beta", "diff_residual"]
    if dtype == torch.float64:
        for name, o, r in zip(names, ours, ref):
            torch.testing.assert_close(o, r, atol=1e-10, rtol=1e-10, msg=name)
        return
    # The bar: torch's unfused composition in `dtype`, or this library's own
    # (its batch_norm then add and activation), whichever is less accurate: the
    # fused operator shares the plain kernels' sums, whose plain runs
    # (exact_sum.h) may leave diff_gamma/diff_beta a few float32 ulps off where
    # native's are within one.
    plain_fn = lambda x, rm, rv, w, b, t, r: torch_activation(  # noqa: E731
        torch_bn_grad.functional.batch_norm(x, rm, rv, w, b, t, 0.1, EPS) + (r if r is not None else 0), activation)
    native = _run(native_fn, *data, dtype, training)
    plain = _run(plain_fn, *data, dtype, training)
    for name, o, n, p, r in zip(names, ours, native, plain, ref):
        err_ours = (o.double() - r).abs().max().item()
        err_bar = max((n.double() - r).abs().max().item(), (p.double() - r).abs().max().item())
        ulp = _ulp(o.dtype, r.abs().max().item())
        assert err_ours <= err_bar * 1.1 + ulp, f"{name}: ours {err_ours:.3e} vs unfused {err_bar:.3e}"


@pytest.mark.parametrize("activation", INVERTIBLE)
@pytest.mark.parametrize("training", [True, False], ids=["train", "frozen"])
@pytest.mark.parametrize("layout", ["rank3", "rank4-cl"])
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
def test_memory_saving_equals_normal_mode(activation, training, layout, with_residual):
    x, r, dy, w, b, rm, rv = rounded_inputs(layout, torch.float32, with_residual)
    results = []
    for memory_saving in (False, True):
        fn = lambda x, rm, rv, w, b, t, r: batch_norm_act(  # noqa: E731
            x, rm, rv, w, b, t, residual=r, activation=activation, negative_slope=SLOPE,
            memory_saving=memory_saving)
        results.append(_run(fn, x, r, dy, w, b, rm, rv, torch.float32, training))
    for a, b_ in zip(*results):
        torch.testing.assert_close(a, b_, atol=2e-5, rtol=2e-5)


def test_memory_saving_keeps_the_output_not_the_input():
    x = torch.randn(4, 3, 8, dtype=torch.float64, requires_grad=True)
    y = batch_norm_act(x, None, None, training=True, activation="leaky_relu", memory_saving=True)
    saved = y.grad_fn._saved_tensors if hasattr(y.grad_fn, "_saved_tensors") else None
    # Whatever the node exposes, the input itself must not be among what it keeps alive.
    if saved is not None:
        assert all(t is None or t.data_ptr() != x.data_ptr() for t in saved)
    with pytest.raises(NotImplementedError, match="memory_saving"):
        (gx,) = torch.autograd.grad(y.sum() * 1.0, x, create_graph=True)
        torch.autograd.grad(gx.sum(), x)


_GRADCHECK_FORMS = {
    "NCX": ((3, 4, 5), "NCX", lambda s: (s[1],)),
    "NXC": ((3, 5, 4), "NXC", lambda s: (s[-1],)),
    "broadcast": ((3, 4, 5), "NCX", lambda s: (1, s[1], s[2])),
}


@pytest.mark.parametrize("form", list(_GRADCHECK_FORMS))
@pytest.mark.parametrize("training", [True, False], ids=["train", "frozen"])
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_gradcheck_and_gradgradcheck(activation, with_residual, training, form):
    shape, data_format, stats_shape = _GRADCHECK_FORMS[form]
    g = torch.Generator().manual_seed(1)
    x = torch.randn(shape, generator=g, dtype=torch.float64, requires_grad=True)
    gamma = (torch.rand(stats_shape(shape), generator=g, dtype=torch.float64) + 0.5).requires_grad_()
    beta = torch.randn(stats_shape(shape), generator=g, dtype=torch.float64, requires_grad=True)
    r = torch.randn(shape, generator=g, dtype=torch.float64, requires_grad=True) if with_residual else None
    mean = torch.randn(stats_shape(shape), generator=g, dtype=torch.float64, requires_grad=True)
    var = (torch.rand(stats_shape(shape), generator=g, dtype=torch.float64) + 0.5).requires_grad_()

    def fn(x, gamma, beta, *rest):
        res = rest[0] if with_residual else None
        m, v = (None, None) if training else rest[-2:]
        return torch_bn_grad.batch_norm_act_forward(x, gamma, beta, m, v, residual=res, activation=activation,
                                                    negative_slope=SLOPE, data_format=data_format)[0]

    inputs = (x, gamma, beta) + ((r,) if with_residual else ()) + (() if training else (mean, var))
    assert torch.autograd.gradcheck(fn, inputs)
    grad_out = torch.randn(shape, generator=g, dtype=torch.float64)  # non-uniform upstream gradient
    assert torch.autograd.gradgradcheck(fn, inputs, grad_outputs=(grad_out,))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_opcheck(activation, dtype):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(4, 3, 5, 6, generator=g).to(dtype).to(memory_format=torch.channels_last).requires_grad_()
    r = torch.randn(4, 3, 5, 6, generator=g).to(dtype).requires_grad_()
    gamma = (torch.rand(3, generator=g) + 0.5).requires_grad_()
    beta = torch.randn(3, generator=g).requires_grad_()
    mean, var = torch.randn(3, generator=g), torch.rand(3, generator=g) + 0.5
    fwd = torch.ops.torch_bn_grad.batch_norm_act_forward.default
    torch.library.opcheck(fwd, (x, gamma, beta, None, None, r, EPS, activation, SLOPE, "NCX", False))
    torch.library.opcheck(fwd, (x, gamma, beta, mean, var, None, EPS, activation, SLOPE, "NCX", False))
    y, m, v = fwd(x.detach(), gamma.detach(), beta.detach(), None, None, r.detach(), EPS, activation, SLOPE,
                  "NCX", False)
    bwd = torch.ops.torch_bn_grad.batch_norm_act_backward.default
    dy = torch.randn(x.shape, generator=g).to(dtype)
    args = (dy, x.detach(), y, r.detach(), m, v, gamma.detach(), beta.detach(), EPS, activation, SLOPE, "NCX")
    torch.library.opcheck(bwd, args + (True, False, [True, True, True, True]))
    torch.library.opcheck(bwd, args + (False, False, [False, True, False, True]))
    if activation in INVERTIBLE:
        args = (dy, None, y, r.detach(), m, v, gamma.detach(), beta.detach(), EPS, activation, SLOPE, "NCX")
        torch.library.opcheck(bwd, args + (True, True, [True, True, True, True]))


@pytest.mark.parametrize("form", ["broadcast", "rank1-like-NXC"])
def test_forward_matches_plain_operator_then_activation(form):
    """Every form batch_norm_forward takes (here the DirectML broadcast form and NXC) works fused too."""
    g = torch.Generator().manual_seed(3)
    if form == "broadcast":
        x = torch.randn(4, 5, 6, 7, generator=g)
        gamma = torch.rand(1, 5, 6, 1, generator=g) + 0.5
        fmt = "NCX"
    else:
        x = torch.randn(4, 6, 7, 5, generator=g)
        gamma = torch.rand(5, generator=g) + 0.5
        fmt = "NXC"
    r = torch.randn(x.shape, generator=g)
    for activation in ACTIVATIONS:
        ours, m, v = torch_bn_grad.batch_norm_act_forward(x, gamma, None, residual=r, activation=activation,
                                                          negative_slope=SLOPE, data_format=fmt)
        plain, m2, v2 = torch_bn_grad.batch_norm_forward(x, gamma, None, data_format=fmt)
        torch.testing.assert_close(ours, torch_activation(plain + r, activation), atol=3e-6, rtol=3e-6)
        torch.testing.assert_close((m, v), (m2, v2), atol=0, rtol=0)


def test_running_stats_update_as_batch_norm():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(8, 3, 5, generator=g)
    stats = [torch.zeros(3), torch.ones(3)]
    stats2 = [t.clone() for t in stats]
    batch_norm_act(x, *stats, training=True, momentum=0.3)
    torch_bn_grad.functional.batch_norm(x, *stats2, training=True, momentum=0.3)
    torch.testing.assert_close(stats, stats2, atol=0, rtol=0)
    torch_bn_grad.functional.batch_norm_act(x, *stats, None, None, True, torch.tensor(0.5), EPS)
    torch_bn_grad.functional.batch_norm(x, *stats2, None, None, True, torch.tensor(0.5), EPS)
    torch.testing.assert_close(stats, stats2, atol=0, rtol=0)


@pytest.mark.parametrize("family", ["planes", "rows"])
def test_bitwise_identical_across_thread_counts(family):
    g = torch.Generator().manual_seed(5)
    shape = (64, 32, 40, 40) if family == "planes" else (4096, 300)
    x = torch.randn(shape, generator=g)
    r, dy = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    results = []
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            y, m, v = torch_bn_grad.batch_norm_act_forward(x, None, None, residual=r, activation="silu")
            grads = torch_bn_grad.batch_norm_act_backward(dy, m, v, src=x, dst=y, residual=r, activation="silu")
            results.append((y, m, v, *grads[:3]))
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(*results):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    "call,error,match",
    [
        (lambda x: batch_norm_act(x, None, None, training=True, activation="gelu"), ValueError, "activation"),
        (lambda x: batch_norm_act(x, None, None, training=True, activation="leaky_relu", negative_slope=-0.1),
         ValueError, "negative_slope"),
        (lambda x: batch_norm_act(x, None, None, training=True, activation="relu", memory_saving=True),
         ValueError, "memory_saving"),
        (lambda x: batch_norm_act(x, None, None, training=True, activation="leaky_relu", negative_slope=0.0,
                                  memory_saving=True), ValueError, "memory_saving"),
        (lambda x: batch_norm_act(x, None, None, training=True, residual=torch.zeros(2, 3, 5)), ValueError,
         "residual"),
        (lambda x: batch_norm_act(x, None, None, training=True, residual=x.double()), TypeError, "residual"),
        (lambda x: torch.ops.torch_bn_grad.batch_norm_act_forward(x, None, None, None, None, None, 1e-5, "tanh",
                                                                  0.0, "NCX", False), ValueError, "activation"),
        (lambda x: torch.ops.torch_bn_grad.batch_norm_act_backward(
            x, x, None, None, torch.zeros(3), torch.ones(3), None, None, 1e-5, "relu", 0.0, "NCX", True, False,
            [True] * 4), ValueError, "dst must be given"),
        (lambda x: torch.ops.torch_bn_grad.batch_norm_act_backward(
            x, None, x, None, torch.zeros(3), torch.ones(3), None, torch.zeros(3), 1e-5, "silu", 0.0, "NCX", True,
            True, [True] * 4), ValueError, "invertible"),
        (lambda x: torch.ops.torch_bn_grad.batch_norm_act_backward(
            x, x, x, None, torch.zeros(4), torch.ones(4), None, None, 1e-5, "relu", 0.0, "NCX", True, False,
            [True] * 4), ValueError, "mean must have shape"),
    ],
)
def test_errors_name_the_argument(call, error, match):
    x = torch.randn(2, 3, 4)
    with pytest.raises(error, match=match):
        call(x)


_ISA_SCRIPT = r"""
import json, torch, torch_bn_grad
g = torch.Generator().manual_seed(0)
out = {"isa": torch_bn_grad.cpu_kernel_isa(), "results": []}
for shape, fmt in [((8, 5, 37), "NCX"), ((300, 37), "NCX"), ((4, 9, 5, 19), "NXC")]:
    for dt in (torch.float32, torch.float64):
        x, r, dy = (torch.randn(shape, generator=g).to(dt) for _ in range(3))
        for act in ("identity", "relu", "leaky_relu", "silu"):
            y, m, v = torch_bn_grad.batch_norm_act_forward(x, None, None, residual=r, activation=act,
                                                           negative_slope=0.1, data_format=fmt)
            grads = torch_bn_grad.batch_norm_act_backward(dy, m, v, src=x, dst=y, residual=r, activation=act,
                                                          negative_slope=0.1, data_format=fmt)
            out["results"].append([t.double().flatten().tolist() for t in (y, m, v, *grads)])
print(json.dumps(out))
"""


def test_every_isa_kernel_agrees():
    """Each compiled ISA copy of the fused kernels (vector and scalar activation paths) gives the same results."""
    runs = runs_to_compare(_ISA_SCRIPT)
    base = next(iter(runs.values()))["results"]
    for run in runs.values():
        for case_a, case_b in zip(base, run["results"]):
            for a, b in zip(case_a, case_b):
                torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-4, rtol=1e-4)


def test_backward_operator_refuses_to_be_differentiated():
    x = torch.randn(4, 3, 5, requires_grad=True)
    y, m, v = torch_bn_grad.batch_norm_act_forward(x.detach(), None, None, activation="silu")
    dx = torch_bn_grad.batch_norm_act_backward(torch.ones_like(y), m, v, src=x, dst=y, activation="silu")[0]
    with pytest.raises(NotImplementedError, match="batch_norm_act_forward"):
        dx.sum().backward()
