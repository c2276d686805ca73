"""ONNX export of the masked batch norm, with both exporters.

Modules called with a mask export as standard ONNX: in eval mode
``BatchNormalization`` then ``Where`` (frozen statistics), in training mode
(the dynamo-based exporter on a training-mode model, the TorchScript-based one
with ``training=TrainingMode.TRAINING``) the statistics of the valid positions
(``ReduceSum``). onnxruntime must give the eager outputs (max error <= 1e-5
relative), padded positions exactly 0 whatever they hold. A scripted model
holds the masked operator itself: its symbolic (TorchScript-based exporter)
translates both forms.
"""

from __future__ import annotations

import copy
import pytest
import torch
from torch import Tensor, nn

import torch_bn_grad
from support.interop_models import randomize_batchnorms
from support.masked_reference import padded_batch
from support.onnx_runs import EXPORTERS, assert_close_relative, assert_standard_ops, export, ops, run

pytest.importorskip("onnx", reason="the onnx package is needed to read exported models")
pytest.importorskip("onnxruntime", reason="onnxruntime is needed to run exported models")

pytestmark = pytest.mark.filterwarnings(
    "ignore::DeprecationWarning", "ignore::UserWarning", "ignore::FutureWarning", "ignore::torch.jit.TracerWarning"
)

TRAINING = {"dynamo": {}, "torchscript": {"training": torch.onnx.TrainingMode.TRAINING, "do_constant_folding": False}}


class Masked(nn.Module):
    """One masked BatchNorm (``module(x, mask)``)."""

    def __init__(self, bn: nn.Module) -> None:
        super().__init__()
        self.bn = bn

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        return self.bn(x, mask)


class MaskedBlock(nn.Module):
    """A masked BatchNorm2d, then a masked BatchNormAct2d with a residual (the first's output)."""

    def __init__(self, channels: int = 4) -> None:
        super().__init__()
        self.bn = torch_bn_grad.nn.BatchNorm2d(channels)
        self.bn_act = torch_bn_grad.nn.BatchNormAct2d(channels, activation="silu")

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        y = self.bn(x, mask)
        return self.bn_act(y, y, mask=mask)


class FunctionalMasked(nn.Module):
    """``functional.batch_norm(..., mask=)`` on the module's tensors."""

    def __init__(self, channels: int = 4) -> None:
        super().__init__()
        self.bn = torch_bn_grad.nn.BatchNorm1d(channels)

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        bn = self.bn
        return torch_bn_grad.functional.batch_norm(x, bn.running_mean, bn.running_var, bn.weight, bn.bias,
                                                   self.training, 0.1, bn.eps, mask=mask)


def _randomized(model: nn.Module) -> nn.Module:
    return randomize_batchnorms(model, torch.Generator().manual_seed(0))


MODELS = {
    "bn1d": (lambda: Masked(torch_bn_grad.nn.BatchNorm1d(4)), (5, 4, 12)),  # (N, C, L), mask (N, L)
    "bn2d": (lambda: Masked(torch_bn_grad.nn.BatchNorm2d(4)), (3, 4, 6, 5)),  # (N, C, H, W), mask (N, H, W)
    "act2d_residual": (MaskedBlock, (3, 4, 6, 5)),
    "functional": (FunctionalMasked, (5, 4, 12)),
}


def _batch(shape, seed: int, pad_value: float = float("nan")) -> tuple[Tensor, Tensor]:
    return padded_batch(shape, torch.float32, seed=seed, random_mask=True, pad_value=pad_value)


def _assert_runs_as_eager(proto, eager: nn.Module, x: Tensor, mask: Tensor) -> Tensor:
    """onnxruntime's output equals the eager model's (on a copy: no state changes), 0 at padding."""
    out = run(proto, x, mask)
    with torch.no_grad():
        assert_close_relative(out, copy.deepcopy(eager)(x, mask))
    assert (out.masked_select(~mask.unsqueeze(1)) == 0).all()
    return out


@pytest.mark.parametrize("exporter", EXPORTERS)
@pytest.mark.parametrize("model", list(MODELS))
def test_eval_export_is_batchnormalization_then_where(exporter: str, model: str) -> None:
    make, shape = MODELS[model]
    eager = _randomized(make()).eval()
    x, mask = _batch(shape, seed=1)
    proto = export(copy.deepcopy(eager), (x, mask), exporter)
    assert_standard_ops(proto)
    assert "BatchNormalization" in ops(proto) and "Where" in ops(proto) and "ReduceSum" not in ops(proto)
    for seed in (2, 3):  # other batches, other masks
        _assert_runs_as_eager(proto, eager, *_batch(shape, seed))


@pytest.mark.parametrize("exporter", EXPORTERS)
@pytest.mark.parametrize("model", list(MODELS))
def test_training_export_normalizes_with_the_valid_positions_statistics(exporter: str, model: str) -> None:
    make, shape = MODELS[model]
    eager = _randomized(make()).train()
    x, mask = _batch(shape, seed=1)
    proto = export(copy.deepcopy(eager), (x, mask), exporter, **TRAINING[exporter])
    assert_standard_ops(proto)
    assert "ReduceSum" in ops(proto) and "BatchNormalization" not in ops(proto)
    for seed in (2, 3):
        _assert_runs_as_eager(proto, eager, *_batch(shape, seed))


@pytest.mark.parametrize("exporter", EXPORTERS)
def test_training_export_of_a_batch_without_valid_positions(exporter: str) -> None:
    """A count of 0 (an all-padded batch) runs to zeros, not NaN."""
    make, shape = MODELS["bn1d"]
    eager = _randomized(make()).train()
    x, mask = _batch(shape, seed=1)
    proto = export(copy.deepcopy(eager), (x, mask), exporter, **TRAINING[exporter])
    empty = torch.zeros_like(mask)
    out = _assert_runs_as_eager(proto, eager, x, empty)
    assert (out == 0).all()


def test_torchscript_exporter_training_updates_running_statistics_as_eager() -> None:
    """The TorchScript-based exporter runs the forward once (as for torch's BatchNorm):
    the running statistics move as one eager step moves them."""
    make, shape = MODELS["act2d_residual"]
    exported, eager = _randomized(make()).train(), _randomized(make()).train()
    x, mask = _batch(shape, seed=1, pad_value=0.0)
    export(exported, (x, mask), "torchscript", **TRAINING["torchscript"])
    with torch.no_grad():
        eager(x, mask)
    for (key, want), got in zip(eager.state_dict().items(), exported.state_dict().values()):
        torch.testing.assert_close(got, want, msg=lambda m: f"{key}: {m}")


def test_default_torchscript_export_of_a_training_model_uses_running_statistics() -> None:
    """As torch's BatchNorm: by default the TorchScript-based exporter exports in eval mode."""
    make, shape = MODELS["bn2d"]
    eager = _randomized(make()).train()
    x, mask = _batch(shape, seed=1)
    proto = export(copy.deepcopy(eager), (x, mask), "torchscript")
    assert "BatchNormalization" in ops(proto)
    _assert_runs_as_eager(proto, eager.eval(), *_batch(shape, seed=2))


@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("model", ["bn1d", "act2d_residual"])
def test_scripted_masked_model_exports(model: str, train: bool) -> None:
    """A scripted model calls batch_norm_masked_forward: its symbolic gives the same graphs' outputs."""
    make, shape = MODELS[model]
    eager = _randomized(make()).train(train)
    x, mask = _batch(shape, seed=1)
    scripted = torch.jit.script(copy.deepcopy(eager))
    assert "torch_bn_grad::batch_norm_masked_forward" in str(scripted.bn.forward.inlined_graph)
    proto = export(scripted, (x, mask), "torchscript", **(TRAINING["torchscript"] if train else {}))
    assert_standard_ops(proto)
    assert ("ReduceSum" in ops(proto)) == train and ("BatchNormalization" in ops(proto)) == (not train)
    for seed in (2, 3):
        _assert_runs_as_eager(proto, eager, *_batch(shape, seed))


def test_masked_export_does_not_change_eager_behaviour() -> None:
    """After an export the module runs this library's masked operator again."""
    make, shape = MODELS["bn1d"]
    eager = _randomized(make()).eval()
    x, mask = _batch(shape, seed=1)
    export(eager, (x, mask), "torchscript")
    traced = torch.jit.trace(eager, (x, mask), check_trace=False)
    assert "torch_bn_grad::batch_norm_masked_forward" in str(traced.inlined_graph)
