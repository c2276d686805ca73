"""revert_batchnorm: this library's batch norms (plain, fused, converted or built
directly) back to torch's classes, sharing their state, computing as before in
train and eval mode, and recognized by the torch tools that match
``type(m) is nn.BatchNorm2d`` (``torch.fx.experimental.optimization.fuse``,
``torch.jit.freeze``) and by timm's ``freeze_batch_norm_2d``."""

from __future__ import annotations

import copy
import operator
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn
from torch.fx.experimental.optimization import fuse as fx_fuse
from torch.nn.modules.batchnorm import _BatchNorm

import torch_bn_grad
from torch_bn_grad._rules import activation as _activation
from torch_bn_grad._conversion import revert as _revert
from torch_bn_grad import nn as bn_nn
from support.interop_models import Block, Net, assert_same_state, example_input, randomize_batchnorms
from support.optional_timm import needs_timm, timm

if timm is not None:
    from timm.layers import BatchNormAct2d as TimmBatchNormAct2d
    from timm.layers import freeze_batch_norm_2d


def _ours(model: nn.Module) -> list[str]:
    return [name for name, m in model.named_modules() if isinstance(m, bn_nn.BatchNormBase)]


def _reverted(model: nn.Module) -> nn.Module:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing is left unreverted
        return torch_bn_grad.revert_batchnorm(model)


def _step(model: nn.Module, x: torch.Tensor, train: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One forward (and backward in training): the output and the parameter gradients."""
    model.train(train)
    model.zero_grad(set_to_none=True)
    y = model(x)
    if train:
        (y * torch.linspace(-1, 1, y.numel()).reshape(y.shape)).sum().backward()
    return y.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def _assert_same_steps(reference: nn.Module, reverted: nn.Module, x: torch.Tensor) -> None:
    """Two training steps then eval: outputs, gradients and running statistics equal to kernel rounding."""
    for train in (True, True, False):
        want, want_grads = _step(reference, x, train)
        got, got_grads = _step(reverted, x, train)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
        assert list(got_grads) == list(want_grads)
        for name, grad in want_grads.items():
            torch.testing.assert_close(got_grads[name], grad, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")
    assert_same_state(reference, reverted, rtol=1e-5, atol=1e-6)


def _reference() -> nn.Module:
    torch.manual_seed(0)
    return randomize_batchnorms(Net(), torch.Generator().manual_seed(0))


def test_converted_model_reverts_to_torch_classes_computing_as_before():
    reference = _reference()
    converted = torch_bn_grad.convert_batchnorm(copy.deepcopy(reference))
    assert _ours(converted)
    reverted = _reverted(copy.deepcopy(converted))
    assert not _ours(reverted)
    assert [type(m) for m in reverted.modules()] == [type(m) for m in reference.modules()]
    _assert_same_steps(reference, reverted, example_input())


def test_state_hooks_training_and_requires_grad_are_taken_over():
    bn = bn_nn.BatchNorm2d(4).eval()
    bn.weight.requires_grad_(False)
    seen = []
    handle = bn.register_forward_hook(lambda m, args, out: seen.append(type(m)))
    bn.register_state_dict_post_hook(lambda m, state, prefix, local: state.update({prefix + "extra": 1}))
    tensors = {**dict(bn.named_parameters()), **dict(bn.named_buffers())}
    model = nn.Sequential(nn.Conv2d(3, 4, 1), bn)
    reverted = _reverted(model)
    assert reverted is model  # children replaced in place, the root returned
    new = model[1]
    assert type(new) is nn.BatchNorm2d and not new.training and not new.weight.requires_grad
    assert {**dict(new.named_parameters()), **dict(new.named_buffers())} == tensors
    assert all(new._parameters[k] is v for k, v in tensors.items() if k in new._parameters)
    model(torch.randn(2, 3, 5, 5))
    assert seen == [nn.BatchNorm2d]
    assert "1.extra" in model.state_dict()
    handle.remove()
    model(torch.randn(2, 3, 5, 5))
    assert seen == [nn.BatchNorm2d]


def test_every_class_and_the_root():
    """Each of this library's classes built directly (not converted), as the root too."""
    for ours, theirs, shape in [(bn_nn.BatchNorm1d, nn.BatchNorm1d, (4, 3)), (bn_nn.BatchNorm2d, nn.BatchNorm2d,
                                (2, 3, 4, 4)), (bn_nn.BatchNorm3d, nn.BatchNorm3d, (2, 3, 2, 2, 2)),
                                (bn_nn.SyncBatchNorm, nn.SyncBatchNorm, (2, 3, 4, 4))]:
        module = randomize_batchnorms(ours(3, momentum=None), torch.Generator().manual_seed(1))
        reference = copy.deepcopy(module)
        reverted = _reverted(module)
        assert type(reverted) is theirs
        x = torch.randn(shape, generator=torch.Generator().manual_seed(2))
        _assert_same_steps(reference, reverted, x)
    group = object()
    sync = bn_nn.SyncBatchNorm(3, process_group=group)  # type: ignore[arg-type]
    assert _reverted(sync).process_group is group


@pytest.mark.parametrize("activation, slope, module", [
    ("relu", 0.01, nn.ReLU), ("leaky_relu", 0.2, nn.LeakyReLU), ("silu", 0.01, nn.SiLU),
    ("identity", 0.01, nn.Identity)])
def test_fused_sequential_pair_gets_its_activation_back(activation, slope, module):
    torch.manual_seed(0)
    act = {"relu": nn.ReLU(), "leaky_relu": nn.LeakyReLU(slope), "silu": nn.SiLU(), "identity": nn.Identity()}
    reference = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), act[activation], nn.Conv2d(4, 2, 1))
    randomize_batchnorms(reference, torch.Generator().manual_seed(0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # identity is not an activation the fuser looks for
        fused = torch_bn_grad.convert_batchnorm(copy.deepcopy(reference), fuse=True)
    if activation != "identity":
        assert type(fused[1]) is bn_nn.BatchNormAct2d and type(fused[2]) is nn.Identity
    reverted = _reverted(fused)
    assert [type(m) for m in reverted] == [nn.Conv2d, nn.BatchNorm2d, module, nn.Conv2d]
    if activation == "leaky_relu":
        assert reverted[2].negative_slope == slope
    assert list(reverted.state_dict()) == list(reference.state_dict())
    _assert_same_steps(reference, reverted, torch.randn(2, 3, 6, 6))


def test_residual_fused_graph_module_gets_its_add_back():
    reference = _reference()
    fused = torch_bn_grad.convert_batchnorm(copy.deepcopy(reference), fuse=True)
    assert isinstance(fused, fx.GraphModule) and any(isinstance(m, bn_nn.BatchNormActBase) for m in fused.modules())
    reverted = _reverted(fused)
    assert not _ours(reverted)
    targets = [n.target for n in reverted.graph.nodes if n.op == "call_function"]
    assert operator.add in targets and targets.count(F.relu) == 4  # stem, block (two), head
    assert list(reverted.state_dict()) == list(reference.state_dict())
    _assert_same_steps(reference, reverted, example_input())


class ResidualCaller(nn.Module):
    """A fused module built directly and called with a residual in the model's own forward."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1)
        self.bn = bn_nn.BatchNormAct2d(4, activation="leaky_relu", negative_slope=0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.conv(x), x)


def test_fused_module_elsewhere_becomes_a_pair_taking_the_residual():
    torch.manual_seed(0)
    model = randomize_batchnorms(ResidualCaller(), torch.Generator().manual_seed(0))
    calls = []
    model.bn.register_forward_hook(lambda m, args, out: calls.append(out.min().item()))
    reference = copy.deepcopy(model)
    reverted = _reverted(model)
    pair = reverted.bn
    assert type(pair) is torch_bn_grad.BatchNormActSequential
    assert type(pair[0]) is nn.BatchNorm2d and type(pair[1]) is nn.LeakyReLU and pair[1].negative_slope == 0.2
    assert not pair[0]._forward_hooks and len(pair._forward_hooks) == 1  # the hook still sees the activation's output
    assert list(reverted.state_dict()) == [k.replace("bn.", "bn.0.") for k in reference.state_dict()]
    x = torch.randn(2, 4, 5, 5)
    _assert_same_steps_renamed(reference, reverted, x)
    # The copied hook fires in the reference too: each pair saw the same (leaky, negative) activation output.
    assert len(calls) == 4 and calls[1::2] == pytest.approx(calls[0::2], rel=1e-5) and max(calls) < 0


def _assert_same_steps_renamed(reference: nn.Module, reverted: nn.Module, x: torch.Tensor) -> None:
    for train in (True, False):
        want, _ = _step(reference, x, train)
        got, _ = _step(reverted, x, train)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(reverted.state_dict()[key.replace("bn.", "bn.0.")], value, rtol=1e-5, atol=1e-6)


def test_scripted_pair_and_jit_freeze_folds_it():
    torch.manual_seed(0)
    model = randomize_batchnorms(ResidualCaller(), torch.Generator().manual_seed(0)).eval()
    reverted = _reverted(copy.deepcopy(model))
    x = torch.randn(2, 4, 5, 5)
    frozen = torch.jit.freeze(torch.jit.script(reverted))
    kinds = [n.kind() for n in frozen.graph.nodes()]
    assert "aten::batch_norm" not in kinds and not any("torch_bn_grad" in k for k in kinds), kinds
    torch.testing.assert_close(frozen(x), model(x), rtol=1e-4, atol=1e-5)
    # Without revert_batchnorm, the scripted model keeps this library's operator.
    kept = [n.kind() for n in torch.jit.freeze(torch.jit.script(model)).graph.nodes()]
    assert "torch_bn_grad::batch_norm_act_forward" in kept or any("torch_bn_grad" in k for k in kept), kept


def test_fx_fuse_folds_reverted_modules():
    reference = _reference().eval()
    converted = torch_bn_grad.convert_batchnorm(copy.deepcopy(reference), fuse=True).eval()
    assert _ours(fx_fuse(converted))  # torch's fuse does not recognize ours
    folded = fx_fuse(_reverted(converted))
    assert not any(isinstance(m, _BatchNorm) for m in folded.modules())  # the head's (Linear, BatchNorm1d) too
    x = example_input()
    torch.testing.assert_close(folded(x), reference(x), rtol=1e-4, atol=1e-5)


def test_sync_fused_and_graph_calls_with_a_mask_are_kept():
    sync = _reverted(nn.Sequential(bn_nn.SyncBatchNormAct(3, activation="silu")))
    assert type(sync[0]) is torch_bn_grad.BatchNormActSequential
    assert type(sync[0][0]) is nn.SyncBatchNorm and type(sync[0][1]) is nn.SiLU

    class Masked(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bn = bn_nn.BatchNormAct1d(3)

        def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            return self.bn(x, mask=mask)

    gm = fx.symbolic_trace(Masked())
    with pytest.warns(UserWarning, match=r"bn \(called with a mask"):
        torch_bn_grad.revert_batchnorm(gm)
    assert type(gm.bn) is bn_nn.BatchNormAct1d


class OwnSubclass(bn_nn.BatchNorm2d):
    """A user's subclass of this library's class: its own methods would be lost in torch's."""


def test_user_subclass_of_ours_is_left_and_named():
    model = nn.Sequential(OwnSubclass(3), bn_nn.BatchNorm2d(3))
    with pytest.warns(UserWarning, match=r"0 \(.*OwnSubclass, a subclass of this library's class\)"):
        torch_bn_grad.revert_batchnorm(model)
    assert type(model[0]) is OwnSubclass and type(model[1]) is nn.BatchNorm2d


class TorchSubclass(nn.BatchNorm2d):
    def scale(self) -> torch.Tensor:
        return self.weight * 2


def test_converted_subclass_reverts_to_the_subclass():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = torch_bn_grad.convert_batchnorm(nn.Sequential(TorchSubclass(3)), subclasses=True)
        synced = torch_bn_grad.convert_batchnorm(nn.Sequential(TorchSubclass(3)), subclasses=True, sync=True)
    assert isinstance(model[0], bn_nn.BatchNormBase) and isinstance(synced[0], bn_nn.SyncBatchNorm)
    for m in (model, synced):
        _reverted(m)
        assert type(m[0]) is TorchSubclass
        torch.testing.assert_close(m[0].scale(), torch.full((3,), 2.0))


@needs_timm
def test_timm_norm_act_reverts_and_freeze_batch_norm_2d_keeps_the_activation():
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Conv2d(3, 4, 3), TimmBatchNormAct2d(4, act_layer=nn.ReLU), nn.Conv2d(4, 4, 1),
                              nn.BatchNorm2d(4), nn.LeakyReLU(0.3)).eval()
    randomize_batchnorms(reference, torch.Generator().manual_seed(0))
    for fuse in (False, True):
        converted = torch_bn_grad.convert_batchnorm(copy.deepcopy(reference), fuse=fuse)
        reverted = _reverted(copy.deepcopy(converted))
        assert [type(m) for m in reverted] == [type(m) for m in reference]
        assert type(reverted[1].act) is nn.ReLU
        x = torch.randn(2, 3, 6, 6)
        torch.testing.assert_close(reverted(x), reference(x), rtol=1e-4, atol=1e-5)
        frozen = freeze_batch_norm_2d(reverted)
        assert not any(type(m) in (nn.BatchNorm2d, TimmBatchNormAct2d) for m in frozen.modules())
        torch.testing.assert_close(frozen(x), reference(x), rtol=1e-4, atol=1e-5)


def test_block_in_train_mode_with_momentum_none():
    """A residual block built with torch's modules, fused, reverted: the cumulative average too."""
    torch.manual_seed(0)
    reference = randomize_batchnorms(Block(4, momentum=None), torch.Generator().manual_seed(3))
    fused = torch_bn_grad.convert_batchnorm(copy.deepcopy(reference), fuse=True)
    _assert_same_steps(reference, _reverted(fused), torch.randn(3, 4, 5, 5))


def test_every_activation_has_a_torch_module():
    for name in _activation.ACTIVATIONS:
        module = _activation.torch_module(name, 0.25)
        y = torch.linspace(-2, 2, 9)
        torch.testing.assert_close(module(y), _activation.activate(y, name, 0.25))


def test_bad_input_names_the_argument():
    with pytest.raises(TypeError, match=r"revert_batchnorm: module must be a torch.nn.Module, got dict"):
        torch_bn_grad.revert_batchnorm({})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"activation must be one of .* got 'gelu'"):
        _activation.torch_module("gelu", 0.01)
