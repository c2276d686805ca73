"""ONNX: ``torch.onnx.export`` of a converted model, with both exporters.

After ``import torch_bn_grad``, ``torch.onnx.export(converted_model, ...)``
needs no extra argument. Each export must give the ONNX graph that the same
export gives for the torch twin (``interop_models.twins``): a standard
``BatchNormalization`` where torch's has one (the exporters fold eval-mode
BatchNorms into a preceding Conv/Gemm, for both), run by onnxruntime with
torch's outputs (max error <= 1e-5 relative). A training-mode model exports as
torch's does: by default both exporters export it as in eval mode; with
``training=TrainingMode.TRAINING`` (TorchScript-based exporter) the
BatchNormalizations use the batch statistics, as torch's.
"""

from __future__ import annotations

import pytest
import torch

import torch_bn_grad
from support.interop_models import assert_same_state, example_input, twins
from support.onnx_runs import EXPORTERS, assert_close_relative, assert_standard_ops, export, ops, run

pytest.importorskip("onnx", reason="the onnx package is needed to read exported models")
pytest.importorskip("onnxruntime", reason="onnxruntime is needed to run exported models")

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning", "ignore::FutureWarning")


def _assert_exports_as_torch(reference, ours, x, exporter, **kwargs):
    expected_proto = export(reference, (x,), exporter, **kwargs)
    proto = export(ours, (x,), exporter, **kwargs)
    assert ops(proto) == ops(expected_proto)
    assert_standard_ops(proto)
    assert [i.name for i in proto.graph.input] == [i.name for i in expected_proto.graph.input]
    assert len(proto.graph.output) == len(expected_proto.graph.output)
    return proto, expected_proto


@pytest.mark.parametrize("exporter", EXPORTERS)
def test_export_eval_model(exporter: str) -> None:
    reference, ours = twins(train=False)
    x = example_input()
    proto, _ = _assert_exports_as_torch(reference, ours, x, exporter)
    for seed in (1, 2):
        x = example_input(seed)
        with torch.no_grad():
            assert_close_relative(run(proto, x), reference(x))


@pytest.mark.parametrize("exporter", EXPORTERS)
@pytest.mark.parametrize("cls, shape", [
    (torch.nn.BatchNorm1d, (5, 4)), (torch.nn.BatchNorm1d, (5, 4, 6)),
    (torch.nn.BatchNorm2d, (3, 4, 5, 6)), (torch.nn.BatchNorm3d, (2, 4, 3, 4, 5)),
])
def test_export_emits_batchnormalization(exporter: str, cls, shape) -> None:
    """Nothing to fold into: a standard BatchNormalization, as for torch's module."""
    torch.manual_seed(0)
    reference = cls(4).eval()
    with torch.no_grad():
        reference.weight.uniform_(0.5, 1.5)
        reference.bias.uniform_(-0.5, 0.5)
        reference.running_mean.uniform_(-0.5, 0.5)
        reference.running_var.uniform_(0.5, 1.5)
    ours = torch_bn_grad.convert_batchnorm(torch.nn.Sequential(reference))[0]
    assert type(ours) is not cls
    x = example_input(3, shape)
    # Wrappers in eval mode too: the exporters put the root's mode back on every child afterwards.
    proto, _ = _assert_exports_as_torch(
        torch.nn.Sequential(reference).eval(), torch.nn.Sequential(ours).eval(), x, exporter
    )
    assert "BatchNormalization" in ops(proto)
    with torch.no_grad():
        assert_close_relative(run(proto, x), reference(x))


@pytest.mark.parametrize("exporter", EXPORTERS)
def test_export_training_model_as_torch(exporter: str) -> None:
    """A model in training mode, default export arguments: the same graph, outputs and state as torch's."""
    reference, ours = twins(train=True)
    x = example_input()
    proto, expected_proto = _assert_exports_as_torch(reference, ours, x, exporter)
    assert ours.training and ours.bn.training
    assert_same_state(reference, ours)
    torch.testing.assert_close(run(proto, x), run(expected_proto, x), rtol=1e-5, atol=1e-6)


def test_export_training_mode_torchscript() -> None:
    """``training=TrainingMode.TRAINING``: BatchNormalizations on the batch statistics, as torch's."""
    reference, ours = twins(train=True)
    x = example_input()
    kwargs = {"training": torch.onnx.TrainingMode.TRAINING, "do_constant_folding": False}
    proto, expected_proto = _assert_exports_as_torch(reference, ours, x, "torchscript", **kwargs)
    assert ops(proto).count("BatchNormalization") == 4
    assert_same_state(reference, ours)
    out = run(proto, x)
    torch.testing.assert_close(out, run(expected_proto, x), rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        assert_close_relative(out, reference(x))


def test_export_does_not_change_eager_behaviour() -> None:
    """After an export the converted model still runs this library's operator."""
    _, ours = twins(train=False)
    export(ours, (example_input(),), "torchscript")
    # Traced in training mode (eval traces torch's batch norm on purpose, test_interop_script.py).
    traced = torch.jit.trace(ours.train(), example_input(), check_trace=False)
    assert "torch_bn_grad::batch_norm_forward" in str(traced.inlined_graph)


def test_export_scripted_eval_model_torchscript() -> None:
    """A ``torch.jit.script``-ed converted model holds the operator itself: it exports too
    (TorchScript-based exporter) to the graph and outputs of the scripted torch twin."""
    reference, ours = twins(train=False)
    x = example_input()
    proto, _ = _assert_exports_as_torch(torch.jit.script(reference), torch.jit.script(ours), x, "torchscript")
    with torch.no_grad():
        assert_close_relative(run(proto, x), reference(x))


@pytest.mark.parametrize("affine", [True, False])
def test_export_scripted_batchnorm_emits_batchnormalization(affine: bool) -> None:
    torch.manual_seed(0)
    reference = torch.nn.BatchNorm2d(4, affine=affine).eval()
    with torch.no_grad():
        reference.running_mean.uniform_(-0.5, 0.5)
        reference.running_var.uniform_(0.5, 1.5)
    ours = torch_bn_grad.convert_batchnorm(torch.nn.Sequential(reference)).eval()
    x = example_input(4, (3, 4, 5, 6))
    proto = export(torch.jit.script(ours), (x,), "torchscript", do_constant_folding=False)
    assert "BatchNormalization" in ops(proto)
    with torch.no_grad():
        assert_close_relative(run(proto, x), reference(x))


def test_export_scripted_training_operator_raises_clearly() -> None:
    """The operator with batch statistics has no ONNX translation: a clear export error."""
    _, ours = twins(train=True)
    x = example_input()
    with pytest.raises(Exception, match="batch statistics"):
        export(torch.jit.script(ours), (x,), "torchscript", training=torch.onnx.TrainingMode.TRAINING)
