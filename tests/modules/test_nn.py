"""Module parity with torch.nn.BatchNorm1d/2d/3d on every device (on CUDA
against torch's native CUDA modules), state_dicts, convert_batchnorm."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch

import torch_bn_grad
from torch_bn_grad import nn as bn_nn
from support.reference import assert_modules_match

MODULES = {
    "1d-NC": (torch.nn.BatchNorm1d, bn_nn.BatchNorm1d, (16, 6)),
    "1d-NCL": (torch.nn.BatchNorm1d, bn_nn.BatchNorm1d, (8, 6, 5)),
    "2d": (torch.nn.BatchNorm2d, bn_nn.BatchNorm2d, (4, 6, 5, 7)),
    "3d": (torch.nn.BatchNorm3d, bn_nn.BatchNorm3d, (2, 6, 3, 4, 5)),
}
CONFIGS = {
    "default": dict(),
    "momentum-none": dict(momentum=None),
    "no-affine": dict(affine=False),
    "no-running-stats": dict(track_running_stats=False),
    "momentum-0.3-eps-1e-3": dict(momentum=0.3, eps=1e-3),
}


def _pair(kind, config, device):
    torch_cls, our_cls, shape = MODULES[kind]
    ref = torch_cls(shape[1], **CONFIGS[config]).to(device, torch.float64)
    if ref.affine:
        with torch.no_grad():
            ref.weight.uniform_(0.5, 1.5)
            ref.bias.normal_()
    ours = our_cls(shape[1], **CONFIGS[config]).to(device, torch.float64)
    ours.load_state_dict(ref.state_dict())
    return ref, ours, shape


PARITY = [(k, c, cl) for k, c in itertools.product(MODULES, CONFIGS) for cl in (False, True)
          if not cl or len(MODULES[k][2]) >= 4]  # channels_last exists for 4-D and 5-D


@pytest.mark.parametrize("kind,config,channels_last", PARITY)
def test_training_steps_then_eval_match_torch(kind, config, channels_last, device):
    ref, ours, shape = _pair(kind, config, device)
    fmt = torch.channels_last if len(shape) == 4 else torch.channels_last_3d
    g = torch.Generator().manual_seed(0)
    for step in range(4):
        x = (torch.randn(shape, generator=g, dtype=torch.float64) * (step + 1) + step).to(device)
        if channels_last:
            x = x.to(memory_format=fmt)
        dy = torch.randn(shape, generator=g, dtype=torch.float64).to(device)
        xr, xo = x.clone().requires_grad_(), x.clone().requires_grad_()
        out_r, out_o = ref(xr), ours(xo)
        torch.testing.assert_close(out_o, out_r)
        out_r.backward(dy)
        out_o.backward(dy)
        torch.testing.assert_close(xo.grad, xr.grad)
        for pr, po in zip(ref.parameters(), ours.parameters()):
            torch.testing.assert_close(po.grad, pr.grad)
        for (name, br), (_, bo) in zip(ref.named_buffers(), ours.named_buffers()):
            torch.testing.assert_close(bo, br, msg=f"buffer {name} after step {step}")
    ref.eval()
    ours.eval()
    assert_modules_match(ref, ours, torch.randn(shape, generator=g, dtype=torch.float64).to(device))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_float_and_bfloat16_modules(dtype, device):
    ref = torch.nn.BatchNorm2d(8).to(device, dtype)
    ours = bn_nn.BatchNorm2d(8).to(device, dtype)
    x = torch.randn(4, 8, 6, 6).to(device, dtype)
    torch.testing.assert_close(ours(x), ref(x), atol=2e-2 if dtype == torch.bfloat16 else 1e-5, rtol=1e-2)
    torch.testing.assert_close(ours.running_var, ref.running_var, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("channels_last", [False, True])
def test_half_precision_model_trains(dtype, channels_last, device):
    """A model cast to bfloat16/float16 (half parameters, float32 batch
    statistics) trains: gradients match torch's in the parameters' dtype."""
    ref = torch.nn.BatchNorm2d(8).to(device, dtype)
    ours = bn_nn.BatchNorm2d(8).to(device, dtype)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(4, 8, 6, 6, generator=g).to(device, dtype)
    dy = torch.randn(4, 8, 6, 6, generator=g).to(device, dtype)
    if channels_last:
        x, dy = x.to(memory_format=torch.channels_last), dy.to(memory_format=torch.channels_last)
    grads = []
    for m in (ref, ours):
        xi = x.clone().requires_grad_()
        grads.append(torch.autograd.grad(m(xi), [xi, m.weight, m.bias], dy))
    for a, b in zip(grads[1], grads[0]):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a.float(), b.float(), atol=0.1, rtol=0.05)
    f = torch_bn_grad.BatchNormFunction.apply
    xi = x.clone().requires_grad_()
    w, b = ours.weight, ours.bias
    dx, dw, db = torch.autograd.grad(f(xi, w, b, None, None, 1e-5, "NCX"), [xi, w, b], dy)
    assert dw.dtype == db.dtype == dtype
    torch.testing.assert_close(dx.float(), grads[0][0].float(), atol=0.1, rtol=0.05)


def test_modules_are_torch_batchnorms():
    m = bn_nn.BatchNorm2d(3)
    assert isinstance(m, torch.nn.modules.batchnorm._BatchNorm)
    assert isinstance(m, torch.nn.BatchNorm2d)
    assert set(m.state_dict()) == set(torch.nn.BatchNorm2d(3).state_dict())
    assert bn_nn.BatchNorm2d(3, bias=False).bias is None


@pytest.mark.parametrize("cls,bad_shape", [
    (bn_nn.BatchNorm1d, (2, 3, 4, 5)), (bn_nn.BatchNorm2d, (2, 3, 4)), (bn_nn.BatchNorm3d, (2, 3, 4, 5)),
])
def test_input_rank_checks_match_torch(cls, bad_shape):
    with pytest.raises(ValueError, match="expected"):
        cls(3)(torch.randn(bad_shape))


def test_one_value_per_channel_in_training_raises():
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        bn_nn.BatchNorm1d(3)(torch.randn(1, 3))


def test_empty_batch_leaves_running_stats():
    m = bn_nn.BatchNorm2d(3)
    before = m.running_mean.clone(), m.running_var.clone()
    out = m(torch.randn(0, 3, 4, 4))
    assert out.shape == (0, 3, 4, 4)
    assert torch.equal(m.running_mean, before[0]) and torch.equal(m.running_var, before[1])


@pytest.mark.parametrize("cls", [bn_nn.BatchNorm2d, bn_nn.BatchNormAct2d, bn_nn.SyncBatchNorm])
def test_reassigned_parameters_and_buffers_are_used(cls):
    """The modules read weight, bias and the running buffers from nn.Module's
    dicts: what assignment puts there is what the next forward uses, as in torch's."""
    torch.manual_seed(0)
    ours, ref = cls(3).eval(), torch.nn.BatchNorm2d(3).eval()
    x = torch.randn(4, 3, 5, 5)
    for m in (ours, ref):
        m.weight = torch.nn.Parameter(torch.tensor([2.0, 0.5, 1.5]))
        m.bias = torch.nn.Parameter(torch.tensor([0.1, -0.2, 0.3]))
        m.running_mean = torch.tensor([0.5, -0.5, 0.0])
        m.running_var = torch.tensor([2.0, 0.5, 1.0])
    want = ref(x)
    if cls is bn_nn.BatchNormAct2d:
        want = want.relu()
    torch.testing.assert_close(ours(x), want)
    ours.train()
    ours.running_mean = torch.zeros(3)
    ours(x)
    torch.testing.assert_close(ours.running_mean, 0.1 * x.mean((0, 2, 3)))  # the new buffer was updated


def test_state_dict_loads_both_ways():
    ref = torch.nn.BatchNorm2d(5)
    ref(torch.randn(4, 5, 3, 3))
    ours = bn_nn.BatchNorm2d(5)
    ours.load_state_dict(ref.state_dict())
    for k, v in ref.state_dict().items():
        assert torch.equal(ours.state_dict()[k], v)
    ours(torch.randn(4, 5, 3, 3))
    back = torch.nn.BatchNorm2d(5)
    back.load_state_dict(ours.state_dict())
    for k, v in ours.state_dict().items():
        assert torch.equal(back.state_dict()[k], v)


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3)
        self.bn = torch.nn.BatchNorm2d(4)
        self.block = torch.nn.Sequential(torch.nn.BatchNorm2d(4, momentum=None), torch.nn.ReLU())
        self.head = torch.nn.BatchNorm1d(4, affine=False)
        self.custom = type("MyBN", (torch.nn.BatchNorm2d,), {})(4)
        self.lazy = torch.nn.LazyBatchNorm2d()


def test_convert_batchnorm_shares_tensors_and_state():
    net = _Net()
    net.bn.weight.requires_grad_(False)
    net.block.eval()
    originals = {n: (m.weight, m.bias, m.running_mean, m.running_var, m.num_batches_tracked, m.training)
                 for n, m in net.named_modules() if type(m) in (torch.nn.BatchNorm1d, torch.nn.BatchNorm2d)}
    converted = torch_bn_grad.convert_batchnorm(net)
    assert converted is net
    modules = dict(net.named_modules())
    for name, (w, b, rm, rv, nbt, training) in originals.items():
        m = modules[name]
        assert type(m) in (bn_nn.BatchNorm1d, bn_nn.BatchNorm2d)
        assert m.weight is w and m.bias is b and m.running_mean is rm and m.running_var is rv
        assert m.num_batches_tracked is nbt and m.training == training
    assert net.bn.weight.requires_grad is False
    assert type(net.custom).__name__ == "MyBN"
    assert type(net.lazy) is torch.nn.LazyBatchNorm2d
    snapshot = {n: type(m) for n, m in net.named_modules()}
    torch_bn_grad.convert_batchnorm(net)
    assert snapshot == {n: type(m) for n, m in net.named_modules()}


def test_convert_batchnorm_root_and_training_parity():
    ref = torch.nn.BatchNorm2d(3)
    new = torch_bn_grad.convert_batchnorm(ref)
    assert type(new) is bn_nn.BatchNorm2d and new.weight is ref.weight
    model = torch.nn.Sequential(torch.nn.Conv2d(2, 3, 3), torch.nn.BatchNorm2d(3), torch.nn.ReLU()).double()
    twin = torch_bn_grad.convert_batchnorm(copy.deepcopy(model))
    x = torch.randn(4, 2, 6, 6, dtype=torch.float64)
    torch.testing.assert_close(twin(x), model(x))
