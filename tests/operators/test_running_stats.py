"""The running-statistics update operator (eager steps) against the tensor
arithmetic that traced code uses: the same values, the same in-place semantics,
on every device (CUDA: one kernel for both buffers where they qualify)."""

import pytest
import torch

import torch_bn_grad  # noqa: F401  (registers the operators)
from torch_bn_grad._rules import running_stats as _running_stats
from support.reference import DEVICES

OP = torch.ops.torch_bn_grad.batch_norm_update_running_stats.default


def _python_update(running_mean, running_var, mean, var, count, momentum):
    bessel = count / (count - 1) if count > 1 else 1.0
    running_mean.lerp_(mean.to(running_mean.dtype), momentum)
    running_var.lerp_((var * bessel).to(running_var.dtype), momentum)


def _assert_as_tensor_arithmetic(got, expected, start, end):
    """Bit for bit on the CPU where torch's lerp kernel fuses its multiply-add
    (AVX2, AVX512), as the operator's loop does; where it does not (the DEFAULT
    kernels; CUDA where nvcc did not contract it), within the roundings of
    lerp's unfused steps (relative to its operands, not to a result they may
    cancel to) and one rounding to a half-precision buffer's dtype."""
    if got.is_cpu and torch_bn_grad.cpu_kernel_isa() != "DEFAULT":
        assert torch.equal(got, expected)
        return
    op = torch.promote_types(got.dtype, torch.float32)
    operands = start.to(op).abs() + end.to(op).abs()
    bound = torch.finfo(got.dtype).eps * expected.to(op).abs() + 2 * torch.finfo(op).eps * operands
    assert ((got.to(op) - expected.to(op)).abs() <= bound).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("channels", [3, 16, 37, 1000])
@pytest.mark.parametrize("momentum", [0.1, 0.5, 0.9, 1.0])
@pytest.mark.parametrize("count", [1, 2, 513])
@pytest.mark.parametrize("device", DEVICES)
def test_operator_equals_tensor_arithmetic(device, dtype, channels, momentum, count):
    # Half-precision buffers (a model cast to float16/bfloat16) take float32 batch statistics,
    # as half-precision data's are; on the CPU they are updated in one loop too.
    stats_dtype = torch.promote_types(dtype, torch.float32)
    g = torch.Generator().manual_seed(channels + count)
    rm, rv = torch.randn(channels, generator=g).to(dtype), torch.rand(channels, generator=g).to(dtype)
    mean = torch.randn(channels, generator=g, dtype=stats_dtype) * 100
    var = torch.rand(channels, generator=g, dtype=stats_dtype) * 3
    rm, rv, mean, var = (t.to(device) for t in (rm, rv, mean, var))
    expected_mean, expected_var = rm.clone(), rv.clone()
    _python_update(expected_mean, expected_var, mean, var, count, momentum)
    start_mean, start_var = rm.clone(), rv.clone()
    OP(rm, rv, mean, var, count, momentum)
    bessel = count / (count - 1) if count > 1 else 1.0
    _assert_as_tensor_arithmetic(rm, expected_mean, start_mean, mean)
    _assert_as_tensor_arithmetic(rv, expected_var, start_var, var * bessel)


@pytest.mark.parametrize("device", DEVICES)
def test_empty_batch_and_absent_buffers_change_nothing(device):
    rm, rv = torch.zeros(4, device=device), torch.ones(4, device=device)
    OP(rm, rv, torch.full((4,), 5.0, device=device), torch.full((4,), 5.0, device=device), 0, 0.1)
    assert torch.equal(rm, torch.zeros(4, device=device)) and torch.equal(rv, torch.ones(4, device=device))
    OP(None, rv, torch.full((4,), 5.0, device=device), torch.full((4,), 3.0, device=device), 4, 1.0)
    assert torch.equal(rv, torch.full((4,), 4.0, device=device))
    OP(rm, None, torch.full((4,), 5.0, device=device), torch.full((4,), 3.0, device=device), 4, 0.5)
    assert torch.equal(rm, torch.full((4,), 2.5, device=device)) and torch.equal(rv, torch.full((4,), 4.0, device=device))


@pytest.mark.parametrize("device", DEVICES)
def test_strided_and_mixed_buffers_take_the_general_path(device):
    rm = torch.zeros(8, device=device)[::2]
    rv = torch.ones(4, dtype=torch.float64, device=device)  # float32 statistics into float64 buffers
    OP(rm, rv, torch.ones(4, device=device), torch.full((4,), 2.0, device=device), 3, 0.5)
    assert torch.equal(rm, torch.full((4,), 0.5, device=device))
    assert torch.equal(rv, torch.full((4,), 2.0, dtype=torch.float64, device=device))


@pytest.mark.parametrize("device", DEVICES)
def test_version_counters_are_bumped(device):
    rm, rv = torch.zeros(4, device=device), torch.ones(4, device=device)
    before = (rm._version, rv._version)
    OP(rm, rv, torch.ones(4, device=device), torch.ones(4, device=device), 3, 0.1)
    assert rm._version > before[0] and rv._version > before[1]


def test_bad_shape_names_the_argument():
    with pytest.raises(ValueError, match="running_var must have one value per channel"):
        OP(torch.zeros(4), torch.zeros(5), torch.zeros(4), torch.zeros(4), 3, 0.1)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    args = (torch.zeros(6, device=device), torch.ones(6, device=device), torch.randn(6, device=device),
            torch.rand(6, device=device), 7, 0.1)
    torch.library.opcheck(OP, args)


@pytest.mark.parametrize("device", DEVICES)
def test_module_update_equals_torch(device):
    torch.manual_seed(0)
    ours, native = torch_bn_grad.nn.BatchNorm2d(5).to(device), torch.nn.BatchNorm2d(5).to(device)
    for _ in range(3):
        x = torch.randn(4, 5, 3, 3, device=device) * 3 + 1
        ours(x), native(x)
    torch.testing.assert_close(ours.running_mean, native.running_mean)
    torch.testing.assert_close(ours.running_var, native.running_var)


def test_traced_code_takes_tensor_arithmetic(monkeypatch):
    calls = []
    monkeypatch.setattr(_running_stats, "_UPDATE_OP", lambda *a: calls.append(a))
    rm, rv = torch.zeros(3), torch.ones(3)
    # Per-channel counts (SyncBatchNorm's) and tensor momenta (momentum=None) stay tensors.
    _running_stats.update_running_stats(rm, rv, torch.ones(3), torch.ones(3), torch.full((3,), 4.0), 0.1)
    _running_stats.update_running_stats(rm, rv, torch.ones(3), torch.ones(3), 4, torch.tensor(0.1))
    assert not calls
    _running_stats.update_running_stats(rm, rv, torch.ones(3), torch.ones(3), 4, 0.1)
    assert len(calls) == 1


def test_host_count_of_eager_cpu_steps_takes_the_operator(monkeypatch):
    # The masked operators' 0-dim CPU count is read on the host (no device to wait for).
    calls = []
    monkeypatch.setattr(_running_stats, "_UPDATE_OP", lambda *a: calls.append(a))
    rm, rv = torch.zeros(3), torch.ones(3)
    _running_stats.update_running_stats(rm, rv, torch.ones(3), torch.ones(3), torch.tensor(4.0, dtype=torch.float64),
                                        0.1)
    assert len(calls) == 1 and calls[0][4] == 4 and type(calls[0][4]) is int


def test_host_count_keeps_traced_counts_tensors():
    def step(rm, count):
        _running_stats.update_running_stats(rm, None, torch.ones(3), torch.ones(3), count, 0.1)
        return rm

    traced = torch.jit.trace(step, (torch.zeros(3), torch.tensor(4.0)), check_trace=False)
    rm = traced(torch.zeros(3), torch.tensor(0.0))  # an empty batch leaves the statistics alone
    torch.testing.assert_close(rm, torch.zeros(3))


COUNTED = torch.ops.torch_bn_grad.batch_norm_update_running_stats.counted
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="a count held on a GPU needs one")


def _buffers_and_stats(device, dtype, channels, strided=False):
    stats_dtype = torch.promote_types(dtype, torch.float32)
    g = torch.Generator().manual_seed(channels)
    rm, rv = torch.randn(channels, generator=g).to(dtype), torch.rand(channels, generator=g).to(dtype)
    if strided:  # not contiguous: the general path
        rm = torch.stack([rm, rm], 1).to(device)[:, 0]
        rv = torch.stack([rv, rv], 1).to(device)[:, 0]
    mean = torch.randn(channels, generator=g, dtype=stats_dtype) * 100
    var = torch.rand(channels, generator=g, dtype=stats_dtype) * 3
    return tuple(t.to(device) for t in (rm, rv, mean, var))


@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("count", [0, 1, 2, 513])
@pytest.mark.parametrize("device", DEVICES)
def test_counted_operator_equals_the_int_count_one(device, count, dtype, strided):
    """A count held by a 0-dim float64 tensor on the statistics' device (the masked
    forward's) gives bitwise the update of the same count given as an int: on a GPU
    the kernel reads it there, elsewhere the tensor arithmetic; count 0 changes nothing."""
    rm, rv, mean, var = _buffers_and_stats(device, dtype, 37, strided)
    expected_mean, expected_var = rm.clone(), rv.clone()
    OP(expected_mean, expected_var, mean, var, count, 0.3)
    COUNTED(rm, rv, mean, var, torch.tensor(float(count), dtype=torch.float64, device=device), 0.3)
    assert torch.equal(rm, expected_mean) and torch.equal(rv, expected_var)


@pytest.mark.parametrize("device", DEVICES)
def test_counted_operator_checks_and_bumps_versions(device):
    rm, rv = torch.zeros(4, device=device), torch.ones(4, device=device)
    before = (rm._version, rv._version)
    COUNTED(rm, rv, torch.ones(4, device=device), torch.ones(4, device=device),
            torch.tensor(3.0, dtype=torch.float64, device=device), 0.1)
    assert rm._version > before[0] and rv._version > before[1]
    with pytest.raises(ValueError, match="count must be a 0-dim tensor"):
        COUNTED(rm, rv, torch.ones(4, device=device), torch.ones(4, device=device), torch.ones(4, device=device), 0.1)
    args = (rm, rv, torch.randn(4, device=device), torch.rand(4, device=device),
            torch.tensor(5.0, dtype=torch.float64, device=device), 0.1)
    torch.library.opcheck(COUNTED, args)


@needs_cuda
def test_cuda_count_takes_the_counted_operator(monkeypatch):
    """An eager step's count on the GPU (a masked step's) goes to the one-kernel
    operator, never to the host."""
    calls = []
    monkeypatch.setattr(_running_stats, "_COUNTED_UPDATE_OP", lambda *a: calls.append(a))
    rm, rv = torch.zeros(3, device="cuda"), torch.ones(3, device="cuda")
    count = torch.tensor(4.0, dtype=torch.float64, device="cuda")
    _running_stats.update_running_stats(rm, rv, torch.ones(3, device="cuda"), torch.ones(3, device="cuda"), count, 0.1)
    assert len(calls) == 1 and calls[0][4] is count
