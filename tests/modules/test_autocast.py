"""Mixed precision: converted models (plain and fused) under ``torch.autocast``,
as a user trains with AMP. The convolutions run in the low-precision dtype, the
BatchNorms receive its data with float32 parameters; ours must produce the
dtypes torch's modules produce, update the same running statistics, and give a
training step whose gradients are no further from the float64 step than
torch's own modules' are."""

from __future__ import annotations

import copy

import pytest
import torch

import torch_bn_grad
from support.interop_models import Net, randomize_batchnorms, example_input

# The low-precision dtypes autocast offers on each device.
AMP_DTYPES = {"cpu": (torch.bfloat16, torch.float16), "cuda": (torch.float16, torch.bfloat16)}


def _model(device: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = Net()
    randomize_batchnorms(model, torch.Generator().manual_seed(1))
    return model.to(device)


def _step(model, x, target, amp_dtype=None):
    """One training step's output, loss gradients (by parameter name) and buffers."""
    model = copy.deepcopy(model).train()
    device = x.device.type
    with torch.autocast(device, dtype=amp_dtype or torch.float32, enabled=amp_dtype is not None):
        out = model(x)
        loss = torch.nn.functional.cross_entropy(out.float(), target)
    loss.backward()
    grads = {name: p.grad for name, p in model.named_parameters()}
    return out, grads, dict(model.named_buffers())


@pytest.mark.parametrize("fuse", [False, True], ids=["plain", "fused"])
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_amp_training_step_no_worse_than_torch(device, fuse, layout):
    fmt = torch.channels_last if layout == "channels_last" else torch.contiguous_format
    reference = _model(device).to(memory_format=fmt)
    ours = torch_bn_grad.convert_batchnorm(copy.deepcopy(reference), fuse=fuse)
    x = example_input(shape=(8, 3, 10, 10)).to(device).contiguous(memory_format=fmt)
    target = torch.arange(8, device=device) % 5
    _, exact, _ = _step(copy.deepcopy(reference).double(), x.double(), target)  # the float64 step
    for amp_dtype in AMP_DTYPES[device]:
        out_ref, grads_ref, buffers_ref = _step(reference, x, target, amp_dtype)
        out, grads, buffers = _step(ours, x, target, amp_dtype)
        assert out.dtype == out_ref.dtype
        # Errors against the whole gradient's norm: a gradient that is exactly 0
        # (a bias before a BatchNorm) has no relative error to speak of.
        scale = torch.cat([g.double().flatten() for g in exact.values()]).norm()
        for name, g in grads.items():
            ref_error = ((grads_ref[name].double() - exact[name]).norm() / scale).item()
            our_error = ((g.double() - exact[name]).norm() / scale).item()
            # Both round in amp_dtype; ours may differ in its roundings, never be much further off.
            assert our_error <= 1.25 * ref_error + 1e-3, (amp_dtype, name, our_error, ref_error)
        for name, b in buffers.items():  # running statistics: same update, float32 buffers
            assert b.dtype == buffers_ref[name].dtype
            torch.testing.assert_close(b, buffers_ref[name], atol=2e-2, rtol=2e-2)


def test_fused_residual_of_another_dtype_promotes_as_torch(device):
    """act(bn(conv(x)) + x) with x float32 and the conv in bfloat16: torch's add
    promotes to float32; the fused module computes it the same way, unfused."""

    class Skip(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = torch.nn.Conv2d(4, 4, 3, padding=1)
            self.bn = torch.nn.BatchNorm2d(4)

        def forward(self, x):
            return torch.relu(self.bn(self.conv(x)) + x)

    torch.manual_seed(0)
    reference = Skip().to(device)
    fused = torch_bn_grad.convert_batchnorm(copy.deepcopy(reference), fuse=True)
    x = torch.randn(2, 4, 5, 5, device=device)
    amp_dtype = AMP_DTYPES[device][0]
    with torch.autocast(device, dtype=amp_dtype):
        expected, actual = reference(x), fused(x)
    assert actual.dtype == expected.dtype == torch.float32
    torch.testing.assert_close(actual, expected, atol=1e-2, rtol=1e-2)
