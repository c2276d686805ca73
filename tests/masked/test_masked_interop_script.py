"""TorchScript of the masked modules: ``torch.jit.script`` of a model whose
BatchNorms take a mask must give the eager model's outputs, gradients and
running-statistics updates bitwise (the same operators, and the eager
update's tensor form, whose roundings are the update operator's), in training
and eval, through ``torch.jit.save``/``load`` too."""

from __future__ import annotations

import copy
import io
from typing import Optional

import pytest
import torch
from torch import Tensor, nn

import torch_bn_grad
from support.interop_models import randomize_batchnorms
from support.masked_reference import padded_batch

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")


class MaskedNet(nn.Module):
    """Conv1d, a masked BatchNorm1d, then a masked fused block with a residual."""

    def __init__(self, momentum: Optional[float] = 0.1) -> None:
        super().__init__()
        self.conv = nn.Conv1d(3, 6, 3, padding=1)
        self.bn = torch_bn_grad.nn.BatchNorm1d(6, momentum=momentum)
        self.conv2 = nn.Conv1d(6, 6, 3, padding=1)
        self.bn_act = torch_bn_grad.nn.BatchNormAct1d(6, momentum=momentum, activation="leaky_relu",
                                                     negative_slope=0.2)

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        y = self.bn(self.conv(x), mask)
        return self.bn_act(self.conv2(y), y, mask=mask)


def _randomized(model: nn.Module) -> nn.Module:
    return randomize_batchnorms(model, torch.Generator().manual_seed(0))


def _assert_equal_state(expected: nn.Module, actual: nn.Module) -> None:
    actual_state = actual.state_dict()
    for key, value in expected.state_dict().items():
        assert torch.equal(actual_state[key], value), key


def _assert_same_steps(eager: nn.Module, scripted, batches, exact: bool = True) -> None:
    """Forward and backward each ``(inputs, mask)`` through both: outputs, input and
    parameter gradients, and then every parameter and buffer, bitwise equal (else,
    ``exact=False``, to float32 rounding)."""
    def same(a: Tensor, b: Tensor) -> bool:
        if exact:
            return torch.equal(a, b)
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        return True

    for step, (inputs, mask) in enumerate(batches):
        ours = [t.clone().requires_grad_() for t in inputs]
        theirs = [t.clone().requires_grad_() for t in inputs]
        expected, actual = eager(*theirs, mask=mask), scripted(*ours, mask=mask)
        assert same(actual, expected)
        grad = torch.randn(expected.shape, generator=torch.Generator().manual_seed(100 + step))
        expected.backward(grad)
        actual.backward(grad)
        for got, want in zip(ours, theirs):
            assert same(got.grad, want.grad)
    for (name, want), got in zip(eager.named_parameters(), scripted.parameters()):
        assert (want.grad is None) == (got.grad is None), name
        assert want.grad is None or same(got.grad, want.grad), name
    _assert_equal_state(eager, scripted)


def _twins(make, train: bool):
    eager = _randomized(make()).train(train)
    return eager, torch.jit.script(copy.deepcopy(eager))


def _batches(shape, steps: int = 3, pad_value: float = float("nan")):
    """``((x,), mask)`` padded batches, NaN at the padding by default (it must change nothing)."""
    batches = []
    for step in range(steps):
        x, mask = padded_batch(shape, torch.float32, seed=step, pad_value=pad_value)
        batches.append(((x,), mask))
    return batches


@pytest.mark.parametrize("momentum", [0.1, None], ids=["momentum", "cumulative"])
@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("cls, shape", [
    (torch_bn_grad.nn.BatchNorm1d, (4, 5, 11)),  # (N, C, L), mask (N, L)
    (torch_bn_grad.nn.BatchNorm2d, (3, 5, 6, 4)),  # (N, C, H, W), mask (N, H, W)
    (torch_bn_grad.nn.BatchNorm3d, (2, 5, 4, 3, 3)),
])
def test_scripted_masked_batchnorm_matches_eager(cls, shape, train: bool, momentum) -> None:
    eager, scripted = _twins(lambda: cls(5, momentum=momentum), train)
    tracked = scripted.num_batches_tracked.item()
    _assert_same_steps(eager, scripted, _batches(shape))
    if train:
        assert scripted.num_batches_tracked.item() == tracked + 3
        assert not torch.equal(scripted.running_mean, _randomized(cls(5)).running_mean)


@pytest.mark.parametrize("data, parameters", [
    (torch.float64, torch.float64), (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float32),
], ids=str)
def test_scripted_masked_running_statistics_in_every_dtype(data, parameters) -> None:
    """The scripted update (tensor arithmetic) rounds as the eager one (the update operator)."""
    for momentum in (0.1, None):
        eager = torch_bn_grad.nn.BatchNorm1d(6, momentum=momentum).to(parameters)
        scripted = torch.jit.script(copy.deepcopy(eager))
        for step in range(3):
            x, mask = padded_batch((4, 6, 17), data, seed=step, offset=1.5)
            assert torch.equal(scripted(x, mask), eager(x, mask))
        _assert_equal_state(eager, scripted)


@pytest.mark.parametrize("options", [{"affine": False}, {"track_running_stats": False}], ids=str)
def test_scripted_masked_batchnorm_variants(options) -> None:
    for train in (True, False):
        eager, scripted = _twins(lambda: torch_bn_grad.nn.BatchNorm1d(5, **options), train)
        _assert_same_steps(eager, scripted, _batches((4, 5, 9), steps=2))


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("activation", ["relu", "silu"])
def test_scripted_masked_fused_module_with_residual(train: bool, activation: str) -> None:
    """BatchNormAct2d: padded outputs 0 and no gradient there, whatever the residual holds.
    The scripted form adds the residual and activates with torch operations, the eager one
    in the fused operator: the same roundings for relu, silu's own evaluation otherwise."""
    eager, scripted = _twins(lambda: torch_bn_grad.nn.BatchNormAct2d(4, activation=activation), train)
    batches = []
    for step in range(3):
        x, mask = padded_batch((3, 4, 6, 5), torch.float32, seed=20 + step, pad_value=float("nan"))
        residual = torch.randn(x.shape, generator=torch.Generator().manual_seed(step))
        batches.append(((x, torch.where(mask.unsqueeze(1), residual, float("nan"))), mask))
    _assert_same_steps(eager, scripted, batches, exact=activation != "silu")
    (x, residual), mask = batches[0]
    out = scripted(x, residual, mask=mask)
    assert (out.masked_select(~mask.unsqueeze(1)) == 0).all()


def test_scripted_masked_batch_without_valid_positions() -> None:
    """Count 0: zeros out, running statistics untouched, the batch counted."""
    eager, scripted = _twins(lambda: torch_bn_grad.nn.BatchNorm1d(5), True)
    before = copy.deepcopy(scripted.state_dict())
    x = torch.randn(3, 5, 7)
    mask = torch.zeros(3, 7, dtype=torch.bool)
    _assert_same_steps(eager, scripted, [((x,), mask)])
    assert (scripted(x, mask) == 0).all()
    assert torch.equal(scripted.running_mean, before["running_mean"])
    assert torch.equal(scripted.running_var, before["running_var"])
    assert scripted.num_batches_tracked.item() == before["num_batches_tracked"].item() + 2


@pytest.mark.parametrize("momentum", [0.1, None], ids=["momentum", "cumulative"])
def test_scripted_masked_model_saves_loads_and_switches_mode(momentum) -> None:
    eager = _randomized(MaskedNet(momentum)).train()
    buffer = io.BytesIO()
    torch.jit.save(torch.jit.script(copy.deepcopy(eager)), buffer)
    buffer.seek(0)
    loaded = torch.jit.load(buffer)
    graph = str(loaded.bn.forward.inlined_graph) + str(loaded.bn_act.forward.inlined_graph)
    assert graph.count("torch_bn_grad::batch_norm_masked_forward") >= 2
    # Zeros at the padding: the convolutions carry it into valid positions.
    _assert_same_steps(eager, loaded, _batches((4, 3, 12), pad_value=0.0))
    eager.eval()
    loaded.eval()
    _assert_same_steps(eager, loaded, _batches((4, 3, 12), steps=1, pad_value=0.0))


def test_scripted_unmasked_call_still_runs_the_plain_operator() -> None:
    eager, scripted = _twins(lambda: torch_bn_grad.nn.BatchNorm1d(5), True)
    x = torch.randn(4, 5, 6)
    assert torch.equal(scripted(x), eager(x))
    _assert_equal_state(eager, scripted)
    graph = str(scripted.forward.inlined_graph)
    assert "torch_bn_grad::batch_norm_forward" in graph and "aten::batch_norm" not in graph


def test_scripted_mask_errors_name_the_argument_and_change_nothing() -> None:
    _, scripted = _twins(lambda: torch_bn_grad.nn.BatchNorm1d(3), True)
    before = copy.deepcopy(scripted.state_dict())
    x = torch.randn(2, 3, 5)
    with pytest.raises(Exception, match=r"mask must have dtype torch.bool .*got torch.float32"):
        scripted(x, torch.ones(2, 5))
    with pytest.raises(Exception, match=r"mask must have shape \[2, 5\] .*got \[2, 3, 5\]"):
        scripted(x, torch.ones(2, 3, 5, dtype=torch.bool))
    assert all(torch.equal(scripted.state_dict()[k], v) for k, v in before.items())
