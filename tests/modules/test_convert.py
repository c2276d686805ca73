"""convert_batchnorm on subclasses of torch's BatchNorm (timm's BatchNormAct2d
included), with hooks, and on real timm models.

The timm tests build real models (pretrained=False) and compare the converted
model with the original in float64: outputs, parameter gradients and running
statistics, in train and eval mode.
"""

from __future__ import annotations

import copy
import io
import os
import pickle
import subprocess
import sys
import warnings

import pytest
import torch
from torch.nn.modules.batchnorm import _BatchNorm

import torch_bn_grad
from torch_bn_grad import nn as bn_nn
from support.optional_timm import needs_timm, timm

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

BatchNormAct2d = timm.layers.BatchNormAct2d if timm is not None else None


def _is_ours(m: torch.nn.Module) -> bool:
    return isinstance(m, bn_nn.BatchNormBase)


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Equal to within float64 rounding relative to the tensor's largest value (deep
    models in training, with a few values per channel, have large, ill-conditioned
    gradients; ours and torch's sum in different orders)."""
    scale = want.abs().max().item() if want.numel() else 0.0
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7 + 1e-6 * scale, msg=lambda m: f"{what}: {m}")


def _assert_same_run(ref: torch.nn.Module, new: torch.nn.Module, x: torch.Tensor) -> None:
    """One forward and backward of both: equal outputs, input and parameter gradients, buffers."""
    xr = x.clone().requires_grad_()
    xn = x.clone().requires_grad_()
    yr, yn = ref(xr), new(xn)
    _close(yn, yr, "output")
    g = torch.randn_like(yr)
    yr.backward(g)
    yn.backward(g)
    _close(xn.grad, xr.grad, "input gradient")
    gr, gn = _grads(ref), _grads(new)
    assert gr.keys() == gn.keys()
    for name in gr:
        _close(gn[name], gr[name], f"gradient of {name}")
    for (name, br), (_, bn) in zip(ref.named_buffers(), new.named_buffers()):
        _close(bn.double(), br.double(), name)


# ------------------------------------------------------------------ subclasses
class TorchForwardBN(torch.nn.BatchNorm2d):
    """A subclass whose forward is torch's own, with an attribute and a method of its own."""

    def __init__(self, num_features: int) -> None:
        super().__init__(num_features)
        self.tag = "kept"

    def describe(self) -> str:
        return f"{self.tag}:{self.num_features}"


class OwnForwardBN(torch.nn.BatchNorm2d):
    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return super().forward(input) * 2


class TorchForwardSyncBN(torch.nn.SyncBatchNorm):
    pass


def test_subclass_with_torch_forward_is_converted():
    model = torch.nn.Sequential(torch.nn.Conv2d(2, 3, 3), TorchForwardBN(3)).double()
    ref = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch_bn_grad.convert_batchnorm(model, subclasses=True)
    bn = model[1]
    assert _is_ours(bn) and isinstance(bn, TorchForwardBN) and isinstance(bn, torch.nn.BatchNorm2d)
    assert bn.describe() == "kept:3" and type(bn).__name__ == "TorchForwardBN"
    x = torch.randn(4, 2, 6, 6, dtype=torch.float64)
    _assert_same_run(ref, model, x)
    ref.eval(), model.eval()
    _assert_same_run(ref, model, x)
    with pytest.raises(ValueError, match="expected 4D input"):
        bn(torch.randn(4, 3, dtype=torch.float64))


def test_sync_subclass_is_converted_to_our_sync():
    model = torch.nn.Sequential(TorchForwardSyncBN(3)).double()
    ref = copy.deepcopy(model)
    torch_bn_grad.convert_batchnorm(model, subclasses=True)
    assert isinstance(model[0], bn_nn.SyncBatchNorm) and isinstance(model[0], TorchForwardSyncBN)
    _assert_same_run(ref, model, torch.randn(4, 3, 5, dtype=torch.float64))


def test_subclass_with_own_forward_and_lazy_warn():
    model = torch.nn.Sequential(OwnForwardBN(3), torch.nn.LazyBatchNorm2d(), torch.nn.BatchNorm2d(3))
    with pytest.warns(UserWarning) as record:
        torch_bn_grad.convert_batchnorm(model, subclasses=True)
    messages = [str(w.message) for w in record]
    assert len(messages) == 1, messages
    assert "forward of their own: 0 (" in messages[0] and "OwnForwardBN" in messages[0], messages
    assert "Lazy BatchNorms" in messages[0] and "1 (torch.nn.modules.batchnorm.LazyBatchNorm2d)" in messages[0]
    assert type(model[0]) is OwnForwardBN and type(model[1]) is torch.nn.LazyBatchNorm2d
    assert type(model[2]) is bn_nn.BatchNorm2d


def test_lazy_after_first_forward_is_converted():
    model = torch.nn.Sequential(torch.nn.LazyBatchNorm2d())
    model(torch.randn(2, 3, 4, 4))  # materializes: the module becomes a torch BatchNorm2d
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch_bn_grad.convert_batchnorm(model, subclasses=True)
    assert type(model[0]) is bn_nn.BatchNorm2d


def test_convert_twice_changes_nothing_and_sync_flag():
    model = torch.nn.Sequential(TorchForwardBN(3), torch.nn.BatchNorm1d(3))
    torch_bn_grad.convert_batchnorm(model, subclasses=True)
    types = [type(m) for m in model]
    torch_bn_grad.convert_batchnorm(model, subclasses=True)
    torch_bn_grad.convert_batchnorm(model, sync=True, subclasses=True)
    assert [type(m) for m in model] == types
    synced = torch_bn_grad.convert_batchnorm(torch.nn.Sequential(TorchForwardBN(3)), sync=True, subclasses=True)
    assert isinstance(synced[0], bn_nn.SyncBatchNorm) and isinstance(synced[0], TorchForwardBN)


# ------------------------------------------------------------------ state kept
def test_state_is_kept():
    bn = torch.nn.BatchNorm2d(3, momentum=None, eps=1e-3, dtype=torch.float64)
    bn.weight.requires_grad_(False)
    bn.eval()
    bn.extra_attribute = [1, 2]
    tensors = (bn.weight, bn.bias, bn.running_mean, bn.running_var, bn.num_batches_tracked)
    new = torch_bn_grad.convert_batchnorm(bn, subclasses=True)
    assert type(new) is bn_nn.BatchNorm2d and new is not bn
    assert (new.weight, new.bias, new.running_mean, new.running_var, new.num_batches_tracked) == tensors
    assert new.weight.requires_grad is False and new.bias.requires_grad is True
    assert new.training is False and new.momentum is None and new.eps == 1e-3
    assert new.weight.dtype == torch.float64 and new.weight.device == bn.weight.device
    assert new.extra_attribute == [1, 2]
    # The containers are the new module's own: assigning to one does not change the other.
    new.bias = torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))
    assert bn.bias is tensors[1]


def test_bfloat16_and_meta_modules_keep_dtype_and_device():
    for kwargs in ({"dtype": torch.bfloat16}, {"device": "meta"}):
        bn = torch.nn.BatchNorm1d(4, **kwargs)
        new = torch_bn_grad.convert_batchnorm(bn, subclasses=True)
        for name, t in new.state_dict().items():
            assert t.dtype == bn.state_dict()[name].dtype and t.device == bn.state_dict()[name].device


def test_hooks_fire_after_conversion():
    bn = torch.nn.BatchNorm2d(3, dtype=torch.float64)
    calls: list[str] = []
    bn.register_forward_pre_hook(lambda m, args: calls.append("pre"))
    bn.register_forward_hook(lambda m, args, out: calls.append("fwd"))
    bn.register_forward_hook(lambda m, args, kwargs, out: calls.append("fwd-kw"), with_kwargs=True)
    bn.register_full_backward_pre_hook(lambda m, gout: calls.append("bwd-pre"))
    bn.register_full_backward_hook(lambda m, gin, gout: calls.append("bwd"))
    bn.register_state_dict_pre_hook(lambda m, prefix, keep_vars: calls.append("sd-pre"))
    bn.register_state_dict_post_hook(lambda m, sd, prefix, local: calls.append("sd-post"))
    bn.register_load_state_dict_pre_hook(lambda m, sd, prefix, *rest: calls.append("load-pre"))
    bn.register_load_state_dict_post_hook(lambda m, keys: calls.append("load-post"))
    removed = bn.register_forward_hook(lambda m, args, out: calls.append("removed"))

    new = torch_bn_grad.convert_batchnorm(bn, subclasses=True)
    assert type(new) is bn_nn.BatchNorm2d
    removed.remove()  # a handle taken before the conversion still works
    x = torch.randn(2, 3, 4, 4, dtype=torch.float64, requires_grad=True)
    new(x).sum().backward()
    sd = new.state_dict()
    new.load_state_dict(sd)
    assert calls == ["pre", "fwd", "fwd-kw", "bwd-pre", "bwd", "sd-pre", "sd-post", "load-pre", "load-post"]


def test_state_dict_loads_both_ways():
    torch.manual_seed(0)
    for torch_cls, our_cls, shape in ((torch.nn.BatchNorm1d, bn_nn.BatchNorm1d, (4, 3)),
                                      (torch.nn.BatchNorm2d, bn_nn.BatchNorm2d, (4, 3, 2, 2)),
                                      (torch.nn.BatchNorm3d, bn_nn.BatchNorm3d, (4, 3, 2, 2, 2))):
        theirs = torch_cls(3)
        theirs(torch.randn(shape))  # non-trivial running statistics
        with torch.no_grad():
            theirs.weight.uniform_()
            theirs.bias.uniform_()
        mine = our_cls(3)
        mine.load_state_dict(theirs.state_dict())
        back = torch_cls(3)
        back.load_state_dict(mine.state_dict())
        for sd in (mine.state_dict(), back.state_dict()):
            assert sd.keys() == theirs.state_dict().keys()
            for k, v in theirs.state_dict().items():
                torch.testing.assert_close(sd[k], v)


def test_pickle_of_converted_subclass_in_a_fresh_process(tmp_path):
    model = torch_bn_grad.convert_batchnorm(torch.nn.Sequential(TorchForwardSyncBN(3)), subclasses=True)
    assert isinstance(pickle.loads(pickle.dumps(model))[0], TorchForwardSyncBN)
    copied = copy.deepcopy(model)
    assert type(copied[0]) is type(model[0])
    # In a new process the derived class is rebuilt by name (the test module is importable there).
    path = tmp_path / "model.pt"
    torch.save(model, path)
    here = os.path.dirname(os.path.abspath(__file__))
    # The test module's folder, and tests/ for the support package it imports.
    code = (f"import sys, torch; sys.path[:0] = [{here!r}, {os.path.dirname(here)!r}]; "
            f"m = torch.load({str(path)!r}, weights_only=False); "
            "from torch_bn_grad.nn import SyncBatchNorm; assert isinstance(m[0], SyncBatchNorm), type(m[0]); "
            "print(type(m[0]).__mro__[1].__name__)")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "SyncBatchNorm" in result.stdout


# ------------------------------------------------------------------ timm
@needs_timm
def test_timm_batchnormact2d_composition():
    layer = BatchNormAct2d(4, act_layer=torch.nn.SiLU, drop_layer=lambda: torch.nn.Dropout(0.0)).double()
    ref = copy.deepcopy(layer)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        new = torch_bn_grad.convert_batchnorm(layer)  # the default converts timm's norm-act classes
    assert _is_ours(new) and isinstance(new, BatchNormAct2d)
    assert new.act is layer.act and new.drop is layer.drop
    assert new.state_dict().keys() == ref.state_dict().keys()
    x = torch.randn(3, 4, 5, 5, dtype=torch.float64)
    for train in (True, False):
        ref.train(train), new.train(train)
        _assert_same_run(ref, new, x)
    # No act (apply_act=False): the normalization alone.
    plain = BatchNormAct2d(4, apply_act=False).double()
    converted = torch_bn_grad.convert_batchnorm(copy.deepcopy(plain))
    _assert_same_run(plain, converted, x)


@needs_timm
@pytest.mark.parametrize("act", ["relu", "silu", "leaky_relu", "gelu", "hard_swish", "identity"])
@pytest.mark.parametrize("drop", [None, 0.3])
def test_timm_batchnormact2d_default_conversion_keeps_drop_and_act(act, drop):
    """timm's forward (batch norm, drop, act) on this library's batch norm: equal outputs,
    input and parameter gradients and buffers in train and eval, a real Dropout included
    (the same random mask on both sides)."""
    from timm.layers import get_act_layer

    drop_layer = None if drop is None else (lambda: torch.nn.Dropout(drop))
    layer = BatchNormAct2d(4, act_layer=get_act_layer(act), drop_layer=drop_layer, inplace=False).double()
    ref = copy.deepcopy(layer)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        new = torch_bn_grad.convert_batchnorm(layer)
    assert _is_ours(new) and isinstance(new, BatchNormAct2d) and new.act is layer.act and new.drop is layer.drop
    x = torch.randn(3, 4, 5, 5, dtype=torch.float64)
    for train in (True, True, False):
        ref.train(train), new.train(train)
        xr, xn = x.clone().requires_grad_(), x.clone().requires_grad_()
        torch.manual_seed(1)
        yr = ref(xr)
        torch.manual_seed(1)
        yn = new(xn)
        _close(yn, yr, "output")
        g = torch.randn_like(yr)
        yr.backward(g), yn.backward(g)
        _close(xn.grad, xr.grad, "input gradient")
        for (name, pr), (_, pn) in zip(ref.named_parameters(), new.named_parameters()):
            _close(pn.grad, pr.grad, f"gradient of {name}")
        for (name, br), (_, bn) in zip(ref.named_buffers(), new.named_buffers()):
            _close(bn.double(), br.double(), name)


@needs_timm
def test_timm_sync_batchnormact_is_converted():
    from timm.layers import convert_sync_batchnorm

    model = convert_sync_batchnorm(torch.nn.Sequential(BatchNormAct2d(4))).double()
    assert type(model[0]).__name__ == "SyncBatchNormAct"
    ref = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch_bn_grad.convert_batchnorm(model)
    assert isinstance(model[0], bn_nn.SyncBatchNorm) and type(model[0]).__name__ == "SyncBatchNormAct"
    _assert_same_run(ref, model, torch.randn(3, 4, 5, 5, dtype=torch.float64))


TIMM_MODELS = ["efficientnet_b0", "mobilenetv3_small_100", "regnetx_002", "densenet121"]


@needs_timm
@pytest.mark.parametrize("name", TIMM_MODELS)
def test_timm_model_converts_every_batchnorm_by_default(name):
    torch.manual_seed(0)
    model = timm.create_model(name, pretrained=False, num_classes=10).double()
    batchnorms = sum(isinstance(m, _BatchNorm) for m in model.modules())
    assert batchnorms > 0
    ref = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        converted = torch_bn_grad.convert_batchnorm(model)
    assert sum(_is_ours(m) for m in converted.modules()) == batchnorms
    assert sum(isinstance(m, _BatchNorm) and not _is_ours(m) for m in converted.modules()) == 0
    assert converted.state_dict().keys() == ref.state_dict().keys()
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    _assert_same_run(ref, converted, x)  # train: batch statistics, running statistics updated
    ref.eval(), converted.eval()
    for m in (ref, converted):
        m.zero_grad()
    _assert_same_run(ref, converted, x)
    # A state_dict of the converted model loads into a fresh timm model and back.
    fresh = timm.create_model(name, pretrained=False, num_classes=10).double()
    fresh.load_state_dict(converted.state_dict())
    buf = io.BytesIO()
    torch.save(fresh.state_dict(), buf)
    buf.seek(0)
    converted.load_state_dict(torch.load(buf))


def test_subclasses_are_left_alone_by_default_with_one_warning() -> None:
    """The default: torch's exact classes and timm's norm-act classes are replaced; any other
    subclass is named, never skipped silently, and all of them in one warning."""
    model = torch.nn.Sequential(torch.nn.BatchNorm2d(3), TorchForwardBN(3),
                                torch.nn.Sequential(TorchForwardBN(3), OwnForwardBN(3)))
    with pytest.warns(UserWarning) as record:
        torch_bn_grad.convert_batchnorm(model)
    messages = [str(w.message) for w in record]
    assert len(messages) == 1, messages
    assert "subclasses=True" in messages[0]
    for name in ("1 (tests.test_convert.TorchForwardBN)", "2.0 (tests.test_convert.TorchForwardBN)",
                 "2.1 (tests.test_convert.OwnForwardBN)"):
        assert name.replace("tests.", "") in messages[0].replace("tests.", ""), messages[0]
    assert type(model[0]) is torch_bn_grad.nn.BatchNorm2d and type(model[1]) is TorchForwardBN
    assert type(model[2][0]) is TorchForwardBN and type(model[2][1]) is OwnForwardBN
