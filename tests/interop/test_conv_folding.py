"""Folding batch norms into convolutions, with this library's modules: ``fold_conv_batchnorm``
(ours, fused ones included, and torch's), ``torch.ao.quantization.fuse_modules``, inductor's
freezing and ONNX export in eval mode. Each folded model is compared with the original."""

from __future__ import annotations

import copy
import operator
import re
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn
from torch.ao.quantization import fuse_modules
from torch.nn.modules.batchnorm import _BatchNorm

import torch_bn_grad
from torch_bn_grad import nn as bn_nn
from support.interop_models import Net, example_input, randomize_batchnorms
from support import onnx_runs


def _model(fuse: bool = False) -> tuple[nn.Module, nn.Module]:
    """(torch's eval model, ours: converted, fused with ``fuse``)."""
    torch.manual_seed(0)
    reference = randomize_batchnorms(Net(), torch.Generator().manual_seed(0)).eval()
    return reference, torch_bn_grad.convert_batchnorm(copy.deepcopy(reference), fuse=fuse).eval()


def _batch_norms(model: nn.Module) -> list[str]:
    return [name for name, m in model.named_modules() if isinstance(m, _BatchNorm)]


@pytest.mark.parametrize("fuse", [False, True])
def test_fold_conv_batchnorm_on_ours_and_fused(fuse):
    reference, ours = _model(fuse)
    types, state = [type(m) for m in ours.modules()], {k: v.clone() for k, v in ours.state_dict().items()}
    folded = torch_bn_grad.fold_conv_batchnorm(ours)
    assert isinstance(folded, fx.GraphModule) and type(folded).__name__ == "Net"
    # The convolutions' batch norms are gone; the head's (after a Linear) stays, ours.
    assert _batch_norms(folded) == ["bn_head"] and isinstance(folded.bn_head, bn_nn.BatchNormBase)
    x = example_input()
    torch.testing.assert_close(folded(x), reference(x), rtol=1e-4, atol=1e-5)
    if fuse:  # the block's residual add and the ReLUs are nodes after the folded convolutions
        targets = [n.target for n in folded.graph.nodes if n.op == "call_function"]
        assert operator.add in targets and targets.count(F.relu) == 3
    # The input model is untouched.
    assert [type(m) for m in ours.modules()] == types
    assert all(torch.equal(v, state[k]) for k, v in ours.state_dict().items())


def test_fold_conv_batchnorm_on_torch_modules_matches_fx_fuse():
    from torch.fx.experimental.optimization import fuse as fx_fuse

    reference, _ = _model()
    folded = torch_bn_grad.fold_conv_batchnorm(reference)
    assert _batch_norms(folded) == ["bn_head"]
    x = example_input()
    torch.testing.assert_close(folded(x), fx_fuse(reference)(x), rtol=1e-5, atol=1e-6)
    # The same through revert_batchnorm, for a model of ours: torch's fuse then folds it.
    _, ours = _model(fuse=True)
    via_revert = fx_fuse(torch_bn_grad.revert_batchnorm(ours))
    assert not _batch_norms(via_revert)
    torch.testing.assert_close(via_revert(x), reference(x), rtol=1e-4, atol=1e-5)


class Shared(nn.Module):
    """A convolution whose output also feeds another branch, and a batch norm without running statistics."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = bn_nn.BatchNorm2d(4)
        self.conv2 = nn.Conv2d(3, 4, 3)
        self.bn2 = bn_nn.BatchNormAct2d(4, track_running_stats=False, activation="silu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        return self.bn(y) + y + self.bn2(self.conv2(x))


def test_unfoldable_sites_stay_as_they_are():
    model = randomize_batchnorms(Shared(), torch.Generator().manual_seed(0)).eval()
    folded = torch_bn_grad.fold_conv_batchnorm(model)
    assert _batch_norms(folded) == ["bn", "bn2"]
    x = torch.randn(2, 3, 6, 6)
    torch.testing.assert_close(folded(x), model(x))


def test_training_mode_and_bad_input_raise_before_anything():
    _, ours = _model(fuse=True)
    ours.block.train()
    state = {k: v.clone() for k, v in ours.state_dict().items()}
    with pytest.raises(ValueError, match=r"fold_conv_batchnorm: model must be in eval mode .* block\.conv1 -> "
                                         r"block\.bn1"):
        torch_bn_grad.fold_conv_batchnorm(ours)
    assert all(torch.equal(v, state[k]) for k, v in ours.state_dict().items())
    with pytest.raises(TypeError, match=r"fold_conv_batchnorm: model must be a torch.nn.Module, got list"):
        torch_bn_grad.fold_conv_batchnorm([])  # type: ignore[arg-type]


def test_quantization_fuse_modules_folds_ours():
    reference, ours = _model()
    groups = [["conv", "bn", "relu"], ["block.conv1", "block.bn1", "block.relu1"], ["block.conv2", "block.bn2"]]
    fused = fuse_modules(ours, groups)
    assert not [n for n in _batch_norms(fused) if n != "bn_head"]
    assert type(fused.conv).__name__ == "ConvReLU2d" and type(fused.bn) is nn.Identity
    x = example_input()
    torch.testing.assert_close(fused(x), reference(x), rtol=1e-4, atol=1e-5)
    # A model fused by convert_batchnorm(fuse=True), reverted: fuse_modules folds its pairs too.
    sequential = randomize_batchnorms(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU()),
                                      torch.Generator().manual_seed(1)).eval()
    ours_seq = torch_bn_grad.convert_batchnorm(copy.deepcopy(sequential), fuse=True)
    folded = fuse_modules(torch_bn_grad.revert_batchnorm(ours_seq), [["0", "1", "2"]])
    assert not _batch_norms(folded)
    torch.testing.assert_close(folded(x), sequential(x), rtol=1e-4, atol=1e-5)


def _call_lines(code: str) -> list[str]:
    """The kernel and extern calls of an inductor wrapper's ``call``."""
    lines = [line.strip() for line in code.splitlines() if "(" in line]
    calls = [line for line in lines if ("cpp_fused" in line or "extern" in line or "torch.ops" in line)
             and not line.startswith(("cpp_fused", "from", "import"))]
    return [re.sub(r"_frozen_param\d+", "_frozen_param", line) for line in calls]  # numbered per compile


def test_inductor_freezing_folds_ours_as_torch_modules():
    from torch._inductor import config as inductor_config
    from torch._inductor.utils import run_and_get_code

    seq = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 4, 1), nn.BatchNorm2d(4))
    reference = randomize_batchnorms(seq, torch.Generator().manual_seed(0)).eval()
    x = torch.randn(2, 3, 10, 10)
    codes = []
    # config.patch, not monkeypatch: monkeypatch's undo leaves inductor's config module without the
    # setting, which fails every later compile in the process.
    with inductor_config.patch(freezing=True):
        for model in (reference, torch_bn_grad.convert_batchnorm(copy.deepcopy(reference), fuse=True)):
            torch._dynamo.reset()
            with torch.no_grad(), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                out, code = run_and_get_code(torch.compile(model), x)
                torch.testing.assert_close(out, model(x), rtol=1e-4, atol=1e-5)
            codes.append("\n".join(code))
    torch._dynamo.reset()
    calls = _call_lines(codes[1])
    assert calls and not any("torch_bn_grad" in line for line in calls), calls
    assert calls == _call_lines(codes[0])  # the same kernels as torch's folded model


@pytest.mark.parametrize("exporter", onnx_runs.EXPORTERS)
def test_onnx_export_in_eval_runs_and_folds_after_fold_conv_batchnorm(exporter):
    pytest.importorskip("onnx")
    pytest.importorskip("onnxruntime")
    reference, ours = _model(fuse=True)
    x = example_input()
    want = reference(x)
    proto = onnx_runs.export(ours, (x,), exporter)
    onnx_runs.assert_standard_ops(proto)
    onnx_runs.assert_close_relative(onnx_runs.run(proto, x), want)
    folded = onnx_runs.export(torch_bn_grad.fold_conv_batchnorm(ours), (x,), exporter)
    assert onnx_runs.ops(folded).count("BatchNormalization") <= 1, onnx_runs.ops(folded)  # the head's at most
    onnx_runs.assert_close_relative(onnx_runs.run(folded, x), want)
