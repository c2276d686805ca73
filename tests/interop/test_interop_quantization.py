"""torch.fx and torch.ao.quantization with this library's BatchNorms.

Each tool must treat a converted model exactly as it treats the torch twin
(``interop_models.twins``): FX keeps each BatchNorm as one ``call_module`` node
that runs this library's forward; eager fusion (``fuse_modules``,
``fuse_modules_qat``) and FX post-training quantization (``prepare_fx``,
``convert_fx`` with the x86 qconfig mapping) give the same module types, the
same graph and the same numbers as on the twin.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.ao.quantization import (
    fuse_modules,
    fuse_modules_qat,
    get_default_qat_qconfig_mapping,
    get_default_qconfig_mapping,
)
from torch.ao.quantization import quantize_fx

import torch_bn_grad
from torch_bn_grad import _compat
from torch_bn_grad._interop import quantization as _quantization
from support.interop_models import assert_same_state, example_input, torch_type, twins

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")

OUR_TYPES = (torch_bn_grad.nn.BatchNorm1d, torch_bn_grad.nn.BatchNorm2d, torch_bn_grad.nn.BatchNorm3d)
FUSE_GROUPS = [
    ["conv", "bn", "relu"],
    ["block.conv1", "block.bn1", "block.relu1"],
    ["block.conv2", "block.bn2"],
    ["fc1", "bn_head"],
]


def _types(model: torch.nn.Module) -> list[tuple[str, type]]:
    """Every module's name and type (a GraphModule's class is made per instance: GraphModule)."""
    return [(name, torch.fx.GraphModule if isinstance(m, torch.fx.GraphModule) else type(m))
            for name, m in model.named_modules()]


def test_torch_internals_as_expected() -> None:
    """The private torch tables this library extends are there (else: a clear RuntimeError)."""
    _compat.quantization_internals()
    _quantization.register()  # idempotent
    _quantization.register()


# ------------------------------------------------------------------ FX
@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
def test_symbolic_trace_keeps_batchnorm_whole(train: bool) -> None:
    reference, ours = twins(train=train)
    graph_module = torch.fx.symbolic_trace(ours)
    reference_graph_module = torch.fx.symbolic_trace(reference)
    nodes = [(n.op, str(n.target)) for n in graph_module.graph.nodes]
    assert nodes == [(n.op, str(n.target)) for n in reference_graph_module.graph.nodes]
    for name in ("bn", "block.bn1", "block.bn2", "bn_head"):
        assert ("call_module", name) in nodes
        # The graph module runs this library's module, the very same object.
        assert graph_module.get_submodule(name) is ours.get_submodule(name)
    for step in range(2):
        x = example_input(step)
        torch.testing.assert_close(graph_module(x), reference(x))
    assert_same_state(reference, graph_module)


def test_symbolic_trace_of_batchnorm_in_sequential() -> None:
    """Inside any module, a BatchNorm is one node."""
    wrapper = torch.nn.Sequential(torch_bn_grad.nn.BatchNorm1d(3))
    graph_module = torch.fx.symbolic_trace(wrapper)
    assert [n.op for n in graph_module.graph.nodes] == ["placeholder", "call_module", "output"]


def test_user_subclass_is_traced_through_as_with_torch() -> None:
    """A user's subclass of a BatchNorm is not a leaf, for torch's class and ours alike."""

    class Torchs(torch.nn.BatchNorm2d):
        pass

    class Ours(torch_bn_grad.nn.BatchNorm2d):
        pass

    for cls in (Torchs, Ours):
        with pytest.raises(torch.fx.proxy.TraceError):
            torch.fx.symbolic_trace(torch.nn.Sequential(cls(3)))


def _calibrated(model: torch.nn.Module, qconfig_mapping, prepare=quantize_fx.prepare_fx) -> torch.fx.GraphModule:
    prepared = prepare(copy.deepcopy(model), qconfig_mapping, (example_input(),))
    with torch.no_grad():
        for step in range(4):
            prepared(example_input(20 + step))
    return prepared


def test_fx_post_training_quantization_matches_torch() -> None:
    reference, ours = twins(train=False)
    mapping = get_default_qconfig_mapping("x86")
    prepared_ref, prepared_ours = _calibrated(reference, mapping), _calibrated(ours, mapping)
    assert _types(prepared_ours) == _types(prepared_ref)
    assert prepared_ours.code == prepared_ref.code
    quantized_ref = quantize_fx.convert_fx(prepared_ref)
    quantized_ours = quantize_fx.convert_fx(prepared_ours)
    # BatchNorms folded into the convolutions and the Linear, as in torch's.
    assert _types(quantized_ours) == _types(quantized_ref)
    assert not any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in quantized_ours.modules())
    assert isinstance(quantized_ours.conv, torch.ao.nn.intrinsic.quantized.ConvReLU2d)
    assert quantized_ours.code == quantized_ref.code
    for step in range(2):
        x = example_input(40 + step)
        torch.testing.assert_close(quantized_ours(x), quantized_ref(x), rtol=0, atol=0)
    for (name, ref_state), (_, our_state) in zip(quantized_ref.state_dict().items(), quantized_ours.state_dict().items()):
        if isinstance(ref_state, torch.Tensor):
            torch.testing.assert_close(our_state, ref_state, rtol=0, atol=0, msg=lambda m: f"{name}: {m}")


def test_fx_standalone_batchnorm_quantized_as_torch() -> None:
    """A BatchNorm2d after a pooling (nothing to fold into) becomes a quantized BatchNorm2d."""
    torch.manual_seed(0)
    reference = torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3), torch.nn.MaxPool2d(2), torch.nn.BatchNorm2d(4), torch.nn.ReLU()
    ).eval()
    ours = torch_bn_grad.convert_batchnorm(copy.deepcopy(reference))
    mapping = get_default_qconfig_mapping("x86")
    quantized_ref = quantize_fx.convert_fx(_calibrated(reference, mapping))
    quantized_ours = quantize_fx.convert_fx(_calibrated(ours, mapping))
    assert _types(quantized_ours) == _types(quantized_ref)
    assert quantized_ours.code == quantized_ref.code
    x = example_input(3)
    torch.testing.assert_close(quantized_ours(x), quantized_ref(x), rtol=0, atol=0)


def test_fx_quantization_aware_training_matches_torch() -> None:
    reference, ours = twins(train=True)
    mapping = get_default_qat_qconfig_mapping("x86")
    prepared_ref = _calibrated(reference, mapping, quantize_fx.prepare_qat_fx)
    prepared_ours = _calibrated(ours, mapping, quantize_fx.prepare_qat_fx)
    assert _types(prepared_ours) == _types(prepared_ref)
    assert prepared_ours.code == prepared_ref.code
    x = example_input(60)
    torch.testing.assert_close(prepared_ours(x), prepared_ref(x))
    quantized_ref = quantize_fx.convert_fx(prepared_ref.eval())
    quantized_ours = quantize_fx.convert_fx(prepared_ours.eval())
    assert _types(quantized_ours) == _types(quantized_ref)
    torch.testing.assert_close(quantized_ours(x), quantized_ref(x), rtol=0, atol=0)


# ------------------------------------------------------------------ eager fusion
@pytest.mark.parametrize("qat", [False, True], ids=["fuse_modules", "fuse_modules_qat"])
def test_fuse_modules_matches_torch(qat: bool) -> None:
    reference, ours = twins(train=qat)
    fuse = fuse_modules_qat if qat else fuse_modules
    fused_ref = fuse(copy.deepcopy(reference), FUSE_GROUPS)
    fused_ours = fuse(ours, FUSE_GROUPS, inplace=True)
    assert _types(fused_ours) == _types(fused_ref)
    intrinsic = torch.ao.nn.intrinsic
    expected = (intrinsic.ConvBnReLU2d, intrinsic.ConvBn2d, intrinsic.LinearBn1d) if qat else (
        intrinsic.ConvReLU2d, torch.nn.Conv2d, torch.nn.Linear)
    assert (type(fused_ours.conv), type(fused_ours.block.conv2), type(fused_ours.fc1)) == expected
    assert isinstance(fused_ours.bn, torch.nn.Identity)
    for step in range(2):
        x = example_input(step)
        torch.testing.assert_close(fused_ours(x), fused_ref(x))
    assert_same_state(fused_ref, fused_ours)


def test_fuse_modules_qat_shares_tensors() -> None:
    """The fused modules' BatchNorms are torch's, holding the converted model's very tensors."""
    _, ours = twins(train=True)
    weight, running_mean = ours.bn.weight, ours.bn.running_mean
    fused = fuse_modules_qat(ours, [["conv", "bn", "relu"]], inplace=True)
    assert fused.conv[1].weight is weight and fused.conv[1].running_mean is running_mean
    assert type(fused.conv[1]) is torch.nn.BatchNorm2d and fused.conv[1].training


def test_eager_static_quantization_of_batchnorm() -> None:
    """Eager-mode prepare/convert quantize a standalone BatchNorm2d as torch's."""
    torch.manual_seed(0)
    reference = torch.nn.Sequential(
        torch.ao.quantization.QuantStub(), torch.nn.BatchNorm2d(3), torch.ao.quantization.DeQuantStub()
    ).eval()
    reference[1].running_mean.uniform_(-0.5, 0.5)
    ours = torch_bn_grad.convert_batchnorm(copy.deepcopy(reference))
    results = []
    for model in (reference, ours):
        model.qconfig = torch.ao.quantization.get_default_qconfig("x86")
        prepared = torch.ao.quantization.prepare(model)
        prepared(example_input(1, (4, 3, 5, 5)))
        results.append(torch.ao.quantization.convert(prepared))
    assert [type(m) for m in results[1].modules()] == [type(m) for m in results[0].modules()]
    assert type(results[1][1]) is torch.ao.nn.quantized.BatchNorm2d
    x = example_input(2, (4, 3, 5, 5))
    torch.testing.assert_close(results[1](x), results[0](x), rtol=0, atol=0)


def test_types_seen_as_torch() -> None:
    assert [torch_type(cls(2)) for cls in OUR_TYPES] == [
        torch.nn.BatchNorm1d, torch.nn.BatchNorm2d, torch.nn.BatchNorm3d]
