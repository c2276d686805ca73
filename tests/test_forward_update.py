"""``batch_norm_forward.update``: the training forward and the running-statistics
update in one call (an eager step's forward). Its results are bit for bit those
of ``batch_norm_forward`` followed by ``batch_norm_update_running_stats`` with
the elements per channel as count, on every device; autograd, the buffers'
versions, fakes and the eager routing of ``functional.batch_norm``.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import torch_bn_grad
from reference import normalization_inputs

FORWARD = torch.ops.torch_bn_grad.batch_norm_forward.default
FORWARD_UPDATE = torch.ops.torch_bn_grad.batch_norm_forward.update
UPDATE = torch.ops.torch_bn_grad.batch_norm_update_running_stats.default
EPS = 1e-5

# (data dtype, running buffers' dtype): a model's float32 buffers, and those of
# a model cast to half precision (float32 statistics into half buffers).
DTYPES = [(torch.float32, torch.float32), (torch.float64, torch.float64), (torch.bfloat16, torch.float32),
          (torch.float16, torch.float16), (torch.bfloat16, torch.bfloat16)]


def _buffers(channels: int, dtype: torch.dtype, device: str):
    g = torch.Generator().manual_seed(channels)
    return (torch.randn(channels, generator=g).to(device, dtype),
            (torch.rand(channels, generator=g) + 0.5).to(device, dtype))


def _assert_bitwise(actual, expected) -> None:
    for a, b in zip(actual, expected):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a, b) or torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
@pytest.mark.parametrize("dtypes", DTYPES, ids=[f"{d}-{b}".replace("torch.", "") for d, b in DTYPES])
def test_equals_the_forward_then_the_update(device, dtypes, layout):
    dtype, buffer_dtype = dtypes
    x, gamma, beta = normalization_inputs((6, 7, 5, 3), dtype, layout, seed=3, scale=2, offset=4)
    x, gamma, beta = x.to(device), gamma.to(device), beta.to(device)
    rm, rv = _buffers(7, buffer_dtype, device)
    expected_rm, expected_rv = rm.clone(), rv.clone()
    expected = FORWARD(x, gamma, beta, None, None, EPS, "NCX")
    UPDATE(expected_rm, expected_rv, expected[1], expected[2], 6 * 5 * 3, 0.3)
    got = FORWARD_UPDATE(x, gamma, beta, rm, rv, 0.3, EPS, "NCX")
    _assert_bitwise(got, expected)
    _assert_bitwise((rm, rv), (expected_rm, expected_rv))
    assert got[0].stride() == expected[0].stride()


def test_absent_buffers_and_an_empty_batch(device):
    x = torch.randn(4, 3, 2, device=device)
    rm, rv = _buffers(3, torch.float32, device)
    start_rm, start_rv = rm.clone(), rv.clone()
    FORWARD_UPDATE(x, None, None, None, rv, 0.5, EPS, "NCX")  # running_var only
    assert torch.equal(rm, start_rm) and not torch.equal(rv, start_rv)
    FORWARD_UPDATE(x, None, None, rm, None, 0.5, EPS, "NCX")
    assert not torch.equal(rm, start_rm)

    rm, rv = _buffers(3, torch.float32, device)
    dst, mean, var = FORWARD_UPDATE(torch.empty(0, 3, 2, device=device), None, None, rm, rv, 0.5, EPS, "NCX")
    assert dst.shape == (0, 3, 2) and mean.isnan().all() and var.isnan().all()
    start_rm, start_rv = _buffers(3, torch.float32, device)  # an empty batch updates nothing
    assert torch.equal(rm, start_rm) and torch.equal(rv, start_rv)


def test_autograd_is_the_forwards_and_versions_are_bumped(device):
    x, gamma, beta = normalization_inputs((5, 4, 3, 3), torch.float64, "contiguous", seed=5, offset=1)
    x, gamma, beta = (t.to(device).requires_grad_() for t in (x, gamma, beta))
    rm, rv = _buffers(4, torch.float64, device)
    versions = (rm._version, rv._version)
    dy = torch.randn(5, 4, 3, 3, dtype=torch.float64, device=device)
    dst, mean, var = FORWARD_UPDATE(x, gamma, beta, rm, rv, 0.1, EPS, "NCX")
    assert rm._version > versions[0] and rv._version > versions[1]
    loss = (dst * dy).sum() + mean.sum() + (var * 2).sum()  # the statistics are differentiable outputs too
    got = torch.autograd.grad(loss, (x, gamma, beta))
    ref_dst, ref_mean, ref_var = FORWARD(x, gamma, beta, None, None, EPS, "NCX")
    expected = torch.autograd.grad((ref_dst * dy).sum() + ref_mean.sum() + (ref_var * 2).sum(), (x, gamma, beta))
    _assert_bitwise(got, expected)
    torch.autograd.gradcheck(lambda *a: FORWARD_UPDATE(*a, None, None, 0.1, EPS, "NCX"), (x, gamma, beta))


def test_errors_name_the_argument_before_anything_changes():
    x = torch.randn(4, 3, 2)
    rm, rv = torch.zeros(3), torch.ones(5)
    with pytest.raises(ValueError, match="running_var must have one value per channel"):
        FORWARD_UPDATE(x, None, None, rm, rv, 0.1, EPS, "NCX")
    assert torch.equal(rm, torch.zeros(3))
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="running_mean must be on src's device"):
            FORWARD_UPDATE(x, None, None, torch.zeros(3, device="cuda"), None, 0.1, EPS, "NCX")


def test_opcheck(device):
    x, gamma, beta = normalization_inputs((4, 3, 2, 2), torch.float32, "contiguous", seed=1)
    rm, rv = _buffers(3, torch.float32, device)
    torch.library.opcheck(FORWARD_UPDATE, (x.to(device), gamma.to(device), beta.to(device), rm, rv, 0.1, EPS, "NCX"))


class _Ops(TorchDispatchMode):
    """The operators a call reaches below autograd, by name."""

    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


def test_eager_training_steps_take_one_call(device):
    module = torch_bn_grad.nn.BatchNorm2d(3).to(device)
    x = torch.randn(4, 3, 2, 2, device=device)
    with _Ops() as ops:
        module(x)
    assert "torch_bn_grad.batch_norm_forward.update" in ops.names
    assert not any("update_running_stats" in name for name in ops.names)
    # The cumulative average's momentum is a tensor: the forward, then the tensor arithmetic.
    module = torch_bn_grad.nn.BatchNorm2d(3, momentum=None).to(device)
    with _Ops() as ops:
        module(x)
    assert "torch_bn_grad.batch_norm_forward.default" in ops.names
    assert "torch_bn_grad.batch_norm_forward.update" not in ops.names


def test_module_running_statistics_equal_torchs(device):
    torch.manual_seed(0)
    ours, native = torch_bn_grad.nn.BatchNorm1d(6).to(device), torch.nn.BatchNorm1d(6).to(device)
    for _ in range(4):
        x = torch.randn(8, 6, 5, device=device) * 2 + 3
        torch.testing.assert_close(ours(x), native(x))
    torch.testing.assert_close(ours.running_mean, native.running_mean)
    torch.testing.assert_close(ours.running_var, native.running_var)
    assert ours.num_batches_tracked == native.num_batches_tracked
