"""BatchNormAct1d/2d/3d and SyncBatchNormAct against torch's BatchNorm followed by
the residual add and torch's activation: outputs, gradients and running
statistics over training steps and in eval mode, torch's _BatchNorm behaviours
(momentum=None, track_running_stats=False, affine=False), state_dicts both
ways, input checks, argument checks, gradcheck, TorchScript and torch.compile.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

import torch_bn_grad
from torch_bn_grad import nn as bn_nn

CLASSES = {1: (bn_nn.BatchNormAct1d, torch.nn.BatchNorm1d, (6, 3, 5)),
           2: (bn_nn.BatchNormAct2d, torch.nn.BatchNorm2d, (4, 3, 5, 4)),
           3: (bn_nn.BatchNormAct3d, torch.nn.BatchNorm3d, (3, 3, 2, 3, 4))}
ACTIVATIONS = [("identity", 0.01), ("relu", 0.01), ("leaky_relu", 0.2), ("silu", 0.01)]


def _act(y: torch.Tensor, activation: str, slope: float) -> torch.Tensor:
    return {"identity": lambda t: t, "relu": torch.relu, "silu": F.silu,
            "leaky_relu": lambda t: F.leaky_relu(t, slope)}[activation](y)


def _pair(dim: int, activation: str, slope: float, **options):
    """(ours, torch's BatchNorm) with the same random parameters, float64."""
    ours_cls, torch_cls, _ = CLASSES[dim]
    ref = torch_cls(3, **options).double()
    if ref.affine:
        g = torch.Generator().manual_seed(3)
        with torch.no_grad():
            ref.weight.uniform_(0.5, 1.5, generator=g)
            ref.bias.normal_(generator=g)
    ours = ours_cls(3, **options, activation=activation, negative_slope=slope, dtype=torch.float64)
    ours.load_state_dict(ref.state_dict())
    return ours, ref


def _run(module, x, residual, dy, reference=None):
    """Output, input and residual gradients, parameter gradients."""
    x = x.clone().requires_grad_()
    r = residual.clone().requires_grad_() if residual is not None else None
    module.zero_grad(set_to_none=True)
    if reference is None:
        y = module(x, r)
    else:
        activation, slope = reference
        y = module(x)
        y = _act(y + r if r is not None else y, activation, slope)
    y.backward(dy)
    return [y.detach(), x.grad, r.grad if r is not None else None] + [p.grad for p in module.parameters()]


@pytest.mark.parametrize("dim", [1, 2, 3])
@pytest.mark.parametrize("activation,slope", ACTIVATIONS)
@pytest.mark.parametrize("with_residual", [False, True])
def test_matches_torch_batchnorm_then_activation(dim, activation, slope, with_residual):
    ours, ref = _pair(dim, activation, slope)
    shape = CLASSES[dim][2]
    g = torch.Generator().manual_seed(0)
    for step in range(3):
        x = torch.randn(shape, generator=g, dtype=torch.float64) * (step + 1) + step
        residual = torch.randn(shape, generator=g, dtype=torch.float64) if with_residual else None
        dy = torch.randn(shape, generator=g, dtype=torch.float64)
        for got, want in zip(_run(ours, x, residual, dy), _run(ref, x, residual, dy, (activation, slope))):
            torch.testing.assert_close(got, want)
    for got, want in zip(ours.buffers(), ref.buffers()):
        torch.testing.assert_close(got, want)
    assert ours.num_batches_tracked.item() == 3
    ours.eval(), ref.eval()
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    residual = torch.randn(shape, generator=g, dtype=torch.float64) if with_residual else None
    dy = torch.randn(shape, generator=g, dtype=torch.float64)
    for got, want in zip(_run(ours, x, residual, dy), _run(ref, x, residual, dy, (activation, slope))):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("options", [dict(momentum=None), dict(track_running_stats=False), dict(affine=False),
                                     dict(momentum=None, affine=False, eps=1e-3)])
def test_batchnorm_behaviours(options):
    ours, ref = _pair(2, "leaky_relu", 0.1, **options)
    shape = CLASSES[2][2]
    g = torch.Generator().manual_seed(1)
    for mode in ("train", "train", "eval", "train"):
        getattr(ours, mode)(), getattr(ref, mode)()
        x, r, dy = (torch.randn(shape, generator=g, dtype=torch.float64) for _ in range(3))
        for got, want in zip(_run(ours, x, r, dy), _run(ref, x, r, dy, ("leaky_relu", 0.1))):
            torch.testing.assert_close(got, want)
        for got, want in zip(ours.buffers(), ref.buffers()):
            torch.testing.assert_close(got, want)


def test_state_dict_loads_both_ways_and_repr():
    for dim, (ours_cls, torch_cls, _) in CLASSES.items():
        ref = torch_cls(5, momentum=None)
        ref.running_mean.normal_(), ref.running_var.uniform_(1, 2), ref.num_batches_tracked.fill_(7)
        ours = ours_cls(5, momentum=None, activation="silu")
        assert list(ours.state_dict()) == list(ref.state_dict())
        ours.load_state_dict(ref.state_dict())
        back = torch_cls(5)
        back.load_state_dict(ours.state_dict())
        for name, t in ref.state_dict().items():
            assert torch.equal(back.state_dict()[name], t), name
        assert isinstance(ours, torch_cls)
    sync = bn_nn.SyncBatchNormAct(5, activation="relu")
    sync.load_state_dict(torch.nn.SyncBatchNorm(5).state_dict())
    assert repr(bn_nn.BatchNormAct2d(4, activation="leaky_relu", negative_slope=0.2, memory_saving=True)) == (
        "BatchNormAct2d(4, eps=1e-05, momentum=0.1, affine=True, bias=True, track_running_stats=True, "
        "activation='leaky_relu', negative_slope=0.2, memory_saving=True)")
    assert repr(bn_nn.BatchNormAct1d(3)).endswith("track_running_stats=True, activation='relu')")
    for name in ("BatchNormAct1d", "BatchNormAct2d", "BatchNormAct3d", "SyncBatchNormAct"):
        assert name in bn_nn.__all__ and getattr(torch_bn_grad.nn, name) is getattr(bn_nn, name)


def test_input_and_argument_checks():
    with pytest.raises(ValueError, match="expected 4D input"):
        bn_nn.BatchNormAct2d(3)(torch.randn(2, 3, 4))
    with pytest.raises(ValueError, match="expected 2D or 3D input"):
        bn_nn.BatchNormAct1d(3)(torch.randn(2, 3, 4, 4))
    with pytest.raises(ValueError, match="expected 5D input"):
        bn_nn.BatchNormAct3d(3)(torch.randn(2, 3, 4, 4))
    with pytest.raises(ValueError, match="activation must be one of"):
        bn_nn.BatchNormAct2d(3, activation="gelu")
    with pytest.raises(ValueError, match="memory_saving"):
        bn_nn.BatchNormAct2d(3, activation="relu", memory_saving=True)
    with pytest.raises(ValueError, match="memory_saving"):
        bn_nn.BatchNormAct2d(3, activation="leaky_relu", negative_slope=0.0, memory_saving=True)
    with pytest.raises(ValueError, match="Expected more than 1 value per channel"):
        bn_nn.BatchNormAct1d(3)(torch.randn(1, 3))
    assert bn_nn.BatchNormAct2d(3, activation="identity", memory_saving=True).memory_saving
    with pytest.raises(ValueError, match="activation must be one of"):
        torch_bn_grad.functional.batch_norm_act(torch.randn(2, 3), None, None, training=True, activation="tanh")


def test_memory_saving_gives_the_same_results():
    ours, ref = _pair(2, "leaky_relu", 0.05)
    saving = copy.deepcopy(ours)
    saving.memory_saving = True
    g = torch.Generator().manual_seed(2)
    x, r, dy = (torch.randn(CLASSES[2][2], generator=g, dtype=torch.float64) for _ in range(3))
    for got, want in zip(_run(saving, x, r, dy), _run(ours, x, r, dy)):
        torch.testing.assert_close(got, want)


def test_broadcast_residual_is_composed():
    ours, ref = _pair(2, "relu", 0.01)
    g = torch.Generator().manual_seed(4)
    x, dy = (torch.randn(CLASSES[2][2], generator=g, dtype=torch.float64) for _ in range(2))
    r = torch.randn(3, 1, 1, generator=g, dtype=torch.float64)
    for got, want in zip(_run(ours, x, r, dy), _run(ref, x, r, dy, ("relu", 0.01))):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("activation,slope", [("leaky_relu", 0.3), ("silu", 0.01)])
def test_gradcheck(activation, slope):
    m = bn_nn.BatchNormAct2d(2, activation=activation, negative_slope=slope, dtype=torch.float64)
    with torch.no_grad():
        m.weight.copy_(torch.tensor([0.7, 1.3])), m.bias.copy_(torch.tensor([0.2, -0.1]))
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 2, 2, 2, generator=g, dtype=torch.float64, requires_grad=True)
    r = torch.randn(3, 2, 2, 2, generator=g, dtype=torch.float64, requires_grad=True)
    for mode in ("train", "eval"):
        getattr(m, mode)()
        # relu-like kinks: keep points away from zero by the random data (seeded)
        assert torch.autograd.gradcheck(lambda a, b, w, c: torch.func.functional_call(
            m, {"weight": w, "bias": c}, (a, b)), (x, r, m.weight, m.bias))


def test_torchscript_matches_eager():
    ours, _ = _pair(2, "leaky_relu", 0.2, momentum=None)
    scripted = torch.jit.script(copy.deepcopy(ours))
    g = torch.Generator().manual_seed(6)
    for _ in range(2):
        x, r = (torch.randn(CLASSES[2][2], generator=g, dtype=torch.float64) for _ in range(2))
        torch.testing.assert_close(scripted(x, r), ours(x, r))
    for got, want in zip(scripted.buffers(), ours.buffers()):
        torch.testing.assert_close(got, want)


def test_compile_fullgraph_without_breaks():
    ours, ref = _pair(2, "relu", 0.01, momentum=None)
    compiled = torch.compile(copy.deepcopy(ours), backend="aot_eager", fullgraph=True)
    counters.clear()
    g = torch.Generator().manual_seed(7)
    for mode in ("train", "eval"):
        getattr(ours, mode)(), getattr(compiled, mode)()
        x, r, dy = (torch.randn(CLASSES[2][2], generator=g, dtype=torch.float64) for _ in range(3))
        for got, want in zip(_run(compiled, x, r, dy), _run(ours, x, r, dy)):
            torch.testing.assert_close(got, want)
    assert sum(counters["graph_break"].values()) == 0


def test_sync_without_process_group_is_local():
    ours, ref = _pair(2, "silu", 0.01)
    sync = bn_nn.SyncBatchNormAct(3, activation="silu", dtype=torch.float64)
    sync.load_state_dict(ours.state_dict())
    g = torch.Generator().manual_seed(8)
    x, r, dy = (torch.randn(CLASSES[2][2], generator=g, dtype=torch.float64) for _ in range(3))
    for got, want in zip(_run(sync, x, r, dy), _run(ref, x, r, dy, ("silu", 0.01))):
        torch.testing.assert_close(got, want)
