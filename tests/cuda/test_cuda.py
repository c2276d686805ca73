"""CUDA only (conftest.py collects this file only where CUDA is available): our
CUDA operators against our CPU operators on the same inputs, and against
torch's native CUDA batch norm; the operators run on the current CUDA stream.

The float64 reference checks of the CUDA operators are those of test_ops.py,
test_properties.py and test_autograd.py, which run on every device; the shapes
around the persistent single-read variant's limits are checked against it here.
"""

from __future__ import annotations

import itertools
from typing import Optional

import pytest
import torch
from torch import Tensor

import torch_bn_grad
from torch_bn_grad import stages
from support.reference import (DTYPES, HALF_TYPES, Case, assert_close, cases, normalization_inputs, reference_backward,
                       reference_forward)

EPS = 1e-5
CASES = list(cases())
IDS = [str(c) for c in CASES]
MODES = ["training", "frozen"]


def _inputs(case: Case, device: str, training: bool):
    """(x, dy, gamma, beta, mean, var) of `case` on `device`, the same values on
    every device. mean and var are the given statistics when frozen, and in
    training the batch statistics (float64 reference on the CPU, rounded) that
    the backward takes."""
    g = torch.Generator().manual_seed(0)
    x = case.make(g, scale=2.0, offset=0.5, device=device)
    dy = case.make(g, device=device)
    gamma, beta, mean, var = case.params(g, device)
    if training:
        _, mean, var = reference_forward(x.cpu().contiguous(), None, None, None, None, EPS, case.data_format)
        mean, var = mean.to(device, gamma.dtype), var.to(device, gamma.dtype)
    return x, dy, gamma, beta, mean, var


def _run_ours(case: Case, device: str, training: bool):
    """Our forward and backward: (dst, mean, var, diff_src, diff_gamma, diff_beta)."""
    x, dy, gamma, beta, mean, var = _inputs(case, device, training)
    fmt = case.data_format
    given = (None, None) if training else (mean, var)
    dst, used_mean, used_var = torch_bn_grad.batch_norm_forward(x, gamma, beta, *given, data_format=fmt)
    grads = torch_bn_grad.batch_norm_backward(x, dy, mean, var, gamma, data_format=fmt, training=training)
    return dst, used_mean, used_var, *grads


def _assert_outputs_close(actual, expected, case: Case, training: bool, stats: Optional[torch.dtype] = None) -> None:
    """Two results of (dst, mean, var, diff_src, diff_gamma, diff_beta), each
    within test_ops.py's tolerance of the float64 reference: twice that apart.
    The statistics are compared where they were computed (training), at the
    tolerance of `stats` (default: their own dtype's)."""
    dst, mean, var, dx, dg, db = actual
    ref_dst, ref_mean, ref_var, ref_dx, ref_dg, ref_db = expected
    if stats is None:
        stats = torch.float64 if case.dtype == torch.float64 else torch.float32
    m = ref_dst.numel() // case.channels
    assert_close(dst, ref_dst, case.dtype, scale=2)
    if training:
        assert_close(mean, ref_mean, stats, scale=2)
        assert_close(var, ref_var, stats, scale=8)
    assert_close(dx, ref_dx, case.dtype, scale=4)
    assert_close(dg, ref_dg, case.dtype, scale=2 * m)
    assert_close(db, ref_db, case.dtype, scale=2 * m)


@pytest.mark.parametrize("case", CASES, ids=IDS)
@pytest.mark.parametrize("mode", MODES)
def test_cuda_matches_cpu(case, mode):
    training = mode == "training"
    on_cuda = _run_ours(case, "cuda", training)
    on_cpu = _run_ours(case, "cpu", training)
    for t, c in zip(on_cuda, on_cpu):
        assert t.device.type == "cuda"
        assert t.dtype == c.dtype and t.shape == c.shape and t.stride() == c.stride()
    _assert_outputs_close([t.cpu() for t in on_cuda], on_cpu, case, training)


def _persistent_limits(dtype: torch.dtype) -> tuple[int, int]:
    """The largest shapes that the persistent single-read variant takes
    (plan_persistent_plane / plan_persistent_columns in
    csrc/cuda/launch_plan.cuh): elements per channel in the planes
    partition, rows of a channels-innermost tile in the columns partition."""
    planes = 4096 if dtype == torch.float64 else 8192
    rows = 512 if dtype in HALF_TYPES else 1024
    return planes, rows


def _persistent_cases() -> list[Case]:
    """Shapes at, just below and just above the persistent variant's limits,
    in both partitions and every dtype. `vec` channels make 16-byte vectors;
    the columns tiles are 32 bytes of channels wide, so 3 * vec channels are
    one and a half tiles; odd sizes force scalar loads."""
    out = []
    for dtype in DTYPES:
        planes, rows = _persistent_limits(dtype)
        vec = 16 // torch.empty((), dtype=dtype).element_size()
        out += [
            # planes (NCHW-like: a channel's rows span at least 128 bytes)
            Case((2, 3, planes // 2), dtype, "NCX", "contiguous"),  # at the limit, vectors
            Case((2, 3, planes // 2 - 1), dtype, "NCX", "contiguous"),  # just below, scalar
            Case((2, 3, planes // 2 + vec), dtype, "NCX", "contiguous"),  # just above: two kernels
            Case((3, 5, planes // 4 + 1), dtype, "NCX", "contiguous"),  # odd rows, scalar
            Case((3, 4, 9, 15), dtype, "NCX", "contiguous"),  # fewer elements than threads
            # columns (channels innermost)
            Case((rows, 3 * vec), dtype, "NXC", "contiguous"),  # at the limit, vectors, partial tile
            Case((rows - 3, 13), dtype, "NXC", "contiguous"),  # just below, scalar, partial tile
            Case((rows + 1, 3 * vec), dtype, "NXC", "contiguous"),  # just above: two kernels
            Case((4, 3 * vec, 8, rows // 32), dtype, "NCX", "channels_last"),  # at the limit
            Case((7, 5), dtype, "NXC", "contiguous"),  # few rows: a wide tile
        ]
    return out


PERSISTENT_CASES = _persistent_cases()


def _run_reference(case: Case, training: bool):
    """The float64 reference on the inputs of `_run_ours`, in the same order."""
    x, dy, gamma, beta, mean, var = _inputs(case, "cpu", training)
    given = (None, None) if training else (mean, var)
    dst, used_mean, used_var = reference_forward(x, gamma, beta, *given, EPS, case.data_format)
    grads = reference_backward(x, dy, mean, var, gamma, EPS, case.data_format, training)
    return dst, used_mean, used_var, *grads


@pytest.mark.parametrize("case", PERSISTENT_CASES, ids=[str(c) for c in PERSISTENT_CASES])
@pytest.mark.parametrize("mode", MODES)
def test_persistent_variant_matches_reference_and_cpu(case, mode):
    """Around the persistent variant's limits (training forward, and backward
    with the sums in both modes), against the float64 reference and our CPU
    operators."""
    training = mode == "training"
    on_cuda = [t.cpu() for t in _run_ours(case, "cuda", training)]
    _assert_outputs_close(on_cuda, _run_reference(case, training), case, training)
    _assert_outputs_close(on_cuda, _run_ours(case, "cpu", training), case, training)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("partition", ["planes", "columns"])
def test_persistent_variant_is_bitwise_reproducible(dtype, partition):
    planes, rows = _persistent_limits(dtype)
    shape, fmt = ((2, 3, planes // 2 - 1), "NCX") if partition == "planes" else ((rows - 3, 13), "NXC")
    case = Case(shape, dtype, fmt, "contiguous")
    first, second = _run_ours(case, "cuda", True), _run_ours(case, "cuda", True)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


@pytest.mark.parametrize("partition", ["planes", "columns"])
@pytest.mark.parametrize("mode", MODES)
def test_persistent_variant_output_mask(partition, mode):
    """Each subset of the backward's outputs equals the same outputs of the
    full call, bit for bit; without diff_src the kernel writes none."""
    training = mode == "training"
    shape, fmt = ((2, 3, 1000), "NCX") if partition == "planes" else ((600, 12), "NXC")
    case = Case(shape, torch.float32, fmt, "contiguous")
    x, dy, gamma, _, mean, var = _inputs(case, "cuda", training)
    full = torch_bn_grad.batch_norm_backward(x, dy, mean, var, gamma, data_format=fmt, training=training)
    for mask in itertools.product((True, False), repeat=3):
        out = torch_bn_grad.batch_norm_backward(
            x, dy, mean, var, gamma, data_format=fmt, training=training, output_mask=mask
        )
        for o, f, wanted in zip(out, full, mask):
            if wanted:
                assert torch.equal(o, f)
            else:
                assert o is None


def _channels_at_1(t: Tensor, data_format: str) -> Tensor:
    """`t` viewed as (N, C, *), the only form torch's batch norm takes."""
    return t if data_format == "NCX" else t.movedim(-1, 1)


def _channels_back(t: Tensor, data_format: str) -> Tensor:
    """The inverse of `_channels_at_1`."""
    return t if data_format == "NCX" else t.movedim(1, -1)


def _run_native(case: Case, device: str, training: bool):
    """torch's native batch norm (aten.native_batch_norm and its backward) on
    the inputs of `_run_ours`, as (dst, mean, var, diff_src, diff_gamma, diff_beta)."""
    x, dy, gamma, beta, mean, var = _inputs(case, device, training)
    fmt = case.data_format
    xc, dyc = _channels_at_1(x, fmt), _channels_at_1(dy, fmt)
    aten = torch.ops.aten
    running: tuple[Optional[Tensor], Optional[Tensor]] = (None, None) if training else (mean, var)
    dst, save_mean, save_invstd = aten.native_batch_norm(xc, gamma, beta, *running, training, 0.0, EPS)
    if training:
        used = save_mean, (save_invstd.double().pow(-2) - EPS).to(save_mean.dtype)
        saved = mean, (var.double() + EPS).rsqrt().to(var.dtype)  # the statistics our backward takes
    else:
        # As torch's autograd does: the CUDA backward asserts that the forward's
        # (empty, in eval) save_mean and save_invstd are passed, the CPU's ignores them.
        used, saved = (mean, var), (save_mean, save_invstd)
    dx, dg, db = aten.native_batch_norm_backward(dyc, xc, gamma, *running, *saved, training, EPS, [True] * 3)
    return _channels_back(dst, fmt), *used, _channels_back(dx, fmt), dg, db


@pytest.mark.parametrize("case", CASES, ids=IDS)
@pytest.mark.parametrize("mode", MODES)
def test_cuda_matches_torch_native_cuda(case, mode):
    training = mode == "training"
    # torch's CUDA batch norm (2.11, seen on an H200) returns float16 data's
    # statistics rounded to float16 for inputs it does not take in one of its
    # own layouts; ours are float32-exact (test_ops.py checks them against
    # float64), so the two agree only to float16's tolerance there.
    stats = torch.float16 if case.dtype == torch.float16 else None
    _assert_outputs_close(_run_ours(case, "cuda", training), _run_native(case, "cuda", training), case, training,
                          stats)


def test_operators_run_on_the_current_stream():
    """Work queued on a side stream (a copy held back by a spin) is seen by the
    operators called on that stream: they launch on the current stream."""
    g = torch.Generator().manual_seed(1)
    x_cpu, dy_cpu = torch.randn(64, 32, 64, 64, generator=g), torch.randn(64, 32, 64, 64, generator=g)
    x, dy = x_cpu.cuda(), dy_cpu.cuda()
    dst, mean, var = torch_bn_grad.batch_norm_forward(x)
    expected = (dst, mean, var, *torch_bn_grad.batch_norm_backward(x, dy, mean, var))

    late_x, late_dy = torch.zeros_like(x), torch.zeros_like(dy)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # tens of milliseconds before the copies land
        late_x.copy_(x)
        late_dy.copy_(dy)
        dst, mean, var = torch_bn_grad.batch_norm_forward(late_x)
        got = (dst, mean, var, *torch_bn_grad.batch_norm_backward(late_x, late_dy, mean, var))
    side.synchronize()
    for a, b in zip(got, expected):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_stats_affine_matches_cpu_and_the_forward(dtype, layout):
    """The compile lowering's statistics stage on CUDA: the CUDA forward's statistics
    (up to rounding: the forward may take its one-pass persistent kernel) and the CPU
    operator's values."""
    x, gamma, beta = normalization_inputs((6, 5, 7, 9), dtype, layout, seed=7, scale=2, offset=10)
    op = torch.ops.torch_bn_grad.batch_norm_stats_affine.default
    cpu = op(x, gamma, beta, 1e-5, "NCX")
    xd, gd, bd = x.cuda(), gamma.cuda(), beta.cuda()
    cuda = [t.cpu() for t in op(xd, gd, bd, 1e-5, "NCX")]
    _, mean, var = torch.ops.torch_bn_grad.batch_norm_forward.default(xd, gd, bd, None, None, 1e-5, "NCX")
    tol = torch.float64 if dtype == torch.float64 else torch.float32
    assert_close(cuda[0], mean.cpu(), tol)
    assert_close(cuda[1], var.cpu(), tol, scale=4)
    for got, want in zip(cuda, cpu):
        assert_close(got, want, tol, scale=4)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_split_stages_match_cpu(dtype, layout):
    """The split-stage operators (SyncBatchNorm's) on CUDA against ours on the CPU."""
    g = torch.Generator().manual_seed(6)
    x = (torch.randn(6, 5, 7, 9, generator=g) * 2 + 1).to(dtype)
    dy = torch.randn(6, 5, 7, 9, generator=g).to(dtype)
    if layout == "channels_last":
        x, dy = x.to(memory_format=torch.channels_last), dy.to(memory_format=torch.channels_last)
    gamma = (torch.rand(5, generator=g) + 0.5).to(torch.float64 if dtype == torch.float64 else torch.float32)
    results = {}
    for device in ("cpu", "cuda"):
        xd, dyd, gd = x.to(device), dy.to(device), gamma.to(device)
        stats = stages.batch_norm_local_stats(xd)
        count, mean, var = stages.combine_stats(stats[None])
        sums = stages.batch_norm_grad_sums(xd, dyd, mean)
        dx = stages.batch_norm_grad_input(xd, dyd, mean, var, gd, count, sums)
        results[device] = (stats, sums, dx)
    (stats, sums, dx), (stats_cuda, sums_cuda, dx_cuda) = results["cpu"], [t.cpu() for t in results["cuda"]]
    m = x.numel() // 5
    tol = torch.float64 if dtype == torch.float64 else torch.float32  # statistics accumulate in float32
    assert torch.equal(stats_cuda[0], stats[0])
    assert_close(stats_cuda[1], stats[1], tol)
    assert_close(stats_cuda[2] / m, stats[2] / m, tol, scale=4)
    assert_close(sums_cuda, sums, tol, scale=m)  # sums of m terms
    assert_close(dx_cuda, dx, dtype, scale=2)


def _strided_channels(values: Tensor, dtype: torch.dtype) -> Tensor:
    """`values` as every other element of a longer vector: a strided view."""
    spread = torch.zeros(2 * values.numel(), dtype=dtype)
    spread[::2] = values.to(dtype)
    return spread[::2]


# (data dtype, per-channel dtype): the data's own, and float32 for half-precision data.
PER_CHANNEL_DTYPES = [(d, d) for d in (torch.float64, torch.float32, *HALF_TYPES)] + [
    (d, torch.float32) for d in HALF_TYPES]


@pytest.mark.parametrize("dtype,pdt", PER_CHANNEL_DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("training", [True, False])
def test_per_channel_tensors_are_read_and_written_in_their_own_dtype(dtype, pdt, training):
    """The coefficient kernels read gamma, beta and given statistics in their own
    dtype and stride, and write diff_gamma and diff_beta in the statistics' dtype
    (channel_values.cuh): the CUDA operators against the CPU's on the same values."""
    g = torch.Generator().manual_seed(11)
    x = (torch.randn(4, 6, 5, 3, generator=g) * 2 + 1).to(dtype)
    dy = torch.randn(4, 6, 5, 3, generator=g).to(dtype)
    gamma = _strided_channels(torch.rand(6, generator=g) + 0.5, pdt)
    beta = _strided_channels(torch.randn(6, generator=g), pdt)
    mean = _strided_channels(x.double().mean((0, 2, 3)), pdt)
    var = _strided_channels(x.double().var((0, 2, 3), unbiased=False), pdt)
    given = (None, None) if training else (mean, var)
    results = []
    for device in ("cpu", "cuda"):
        on = [t.to(device) if t is not None else None for t in (x, dy, gamma, beta, *given, mean, var)]
        xd, dyd, gd, bd, gm, gv, md, vd = on
        if device == "cuda":  # .to makes a strided view contiguous: rebuild the views on the GPU
            gd, bd, md, vd = (torch.zeros(12, dtype=pdt, device="cuda")[::2].copy_(t)
                              for t in (gamma, beta, mean, var))
            assert gd.stride() == (2,)
            gm, gv = (None, None) if training else (md, vd)
        fwd = torch_bn_grad.batch_norm_forward(xd, gd, bd, gm, gv)
        bwd = torch_bn_grad.batch_norm_backward(xd, dyd, md, vd, gd, training=training)
        results.append([t.cpu() for t in (*fwd, *bwd)])
    cpu, cuda = results
    assert cuda[3].dtype == dtype and cuda[4].dtype == pdt and cuda[5].dtype == pdt
    # Per-channel results round to their own dtype; float32 statistics of half data.
    per_channel = pdt if pdt in HALF_TYPES else (torch.float64 if dtype == torch.float64 else torch.float32)
    m = x.numel() // 6
    assert_close(cuda[0], cpu[0], dtype, scale=2)
    assert_close(cuda[1], cpu[1], per_channel, scale=2)
    assert_close(cuda[2], cpu[2], per_channel, scale=8)
    assert_close(cuda[3], cpu[3], dtype, scale=4)
    assert_close(cuda[4], cpu[4], per_channel, scale=2 * m)
    assert_close(cuda[5], cpu[5], per_channel, scale=2 * m)
