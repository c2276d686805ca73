"""Memory layouts: which layouts run without copying the data, results and
output memory formats for views and channels_last inputs in the broadcast form,
and 64-bit indexing (more than 2^31 elements, marked slow)."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import torch_bn_grad
from support.reference import assert_close, reference_backward, reference_forward, stats_dtype

SHAPE = (4, 6, 5, 8)  # N, C, H, W
SHAPE_3D = (2, 4, 3, 5, 6)  # N, C, D, H, W


def _data_copies(fn, numel: int) -> list[list[int]]:
    """Shapes of the tensor copies of at least `numel` elements made while `fn` runs.

    Every materialization in ATen (contiguous, clone, to, copy back of an
    output) ends in aten::copy_, which the profiler records even when it is
    called from inside the C++ operator.
    """
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        fn()
    return [
        e.input_shapes[0]
        for e in prof.events()
        if e.name == "aten::copy_" and e.input_shapes and math.prod(e.input_shapes[0]) >= numel
    ]


def _run_all(x: torch.Tensor, stats_shape: list[int], data_format: str) -> None:
    """Forward with batch and frozen statistics, and backward in both modes."""
    dt = stats_dtype(x.dtype)
    gamma, beta = torch.ones(stats_shape, dtype=dt), torch.zeros(stats_shape, dtype=dt)
    dy = torch.ones_like(x)  # ones_like keeps x's layout
    _, mean, var = torch_bn_grad.batch_norm_forward(x, gamma, beta, data_format=data_format)
    torch_bn_grad.batch_norm_forward(x, gamma, beta, mean, var, data_format=data_format)
    for training in (True, False):
        torch_bn_grad.batch_norm_backward(x, dy, mean, var, gamma, data_format=data_format, training=training)


def _nchw(memory_format=torch.contiguous_format, shape=SHAPE, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(shape).to(dtype=dtype, memory_format=memory_format)


CL, CL3 = torch.channels_last, torch.channels_last_3d
N, C, H, W = SHAPE
# (name, src factory, statistics shape, data_format)
ZERO_COPY = [
    ("NCHW-1d", lambda dt: _nchw(dtype=dt), [C], "NCX"),
    ("NCHW-[1,C,1,1]", lambda dt: _nchw(dtype=dt), [1, C, 1, 1], "NCX"),
    ("NCHW-[1,1,H,W]", lambda dt: _nchw(dtype=dt), [1, 1, H, W], "NCX"),
    ("NCHW-[1,C,H,1]", lambda dt: _nchw(dtype=dt), [1, C, H, 1], "NCX"),
    ("NCHW-[N,1,1,1]", lambda dt: _nchw(dtype=dt), [N, 1, 1, 1], "NCX"),
    ("NCHW-[1,1,1,1]", lambda dt: _nchw(dtype=dt), [1, 1, 1, 1], "NCX"),
    ("NHWC-1d", lambda dt: torch.randn(N, H, W, C).to(dt), [C], "NXC"),
    # Any dense permutation: the plan follows the strides (here memory order N, W, C, H).
    ("permuted-1d", lambda dt: torch.randn(N, W, C, H).to(dt).permute(0, 2, 3, 1), [C], "NCX"),
    ("NC-1d", lambda dt: torch.randn(N, C).to(dt), [C], "NCX"),
    ("channels_last-1d", lambda dt: _nchw(CL, dtype=dt), [C], "NCX"),
    ("channels_last-[1,C,1,1]", lambda dt: _nchw(CL, dtype=dt), [1, C, 1, 1], "NCX"),
    ("channels_last-[1,1,H,W]", lambda dt: _nchw(CL, dtype=dt), [1, 1, H, W], "NCX"),
    ("channels_last-[N,1,1,1]", lambda dt: _nchw(CL, dtype=dt), [N, 1, 1, 1], "NCX"),
    ("channels_last-[1,1,1,1]", lambda dt: _nchw(CL, dtype=dt), [1, 1, 1, 1], "NCX"),
    ("channels_last_3d-1d", lambda dt: _nchw(CL3, SHAPE_3D, dt), [SHAPE_3D[1]], "NCX"),
    ("channels_last_3d-[1,C,1,1,1]", lambda dt: _nchw(CL3, SHAPE_3D, dt), [1, SHAPE_3D[1], 1, 1, 1], "NCX"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("name,make,stats_shape,data_format", ZERO_COPY, ids=[z[0] for z in ZERO_COPY])
def test_common_layouts_run_without_copying_the_data(name, make, stats_shape, data_format, dtype):
    x = make(dtype)
    assert _data_copies(lambda: _run_all(x, stats_shape, data_format), x.numel()) == []


@pytest.mark.parametrize(
    "memory_format,stats_shape",
    [(torch.contiguous_format, [1, C, 1, W]), (CL, [1, C, H, 1])],
    ids=["NCHW-[1,C,1,W]", "channels_last-[1,C,H,1]"],
)
def test_other_layouts_are_copied_once_per_tensor(memory_format, stats_shape):
    """Kept dims that are not one run in memory are copied: the copy detector above sees copies."""
    x = _nchw(memory_format)
    copies = _data_copies(lambda: _run_all(x, stats_shape, "NCX"), x.numel())
    # forward: src in, dst out; frozen forward: the same; backward (x2): src and diff_dst in, diff_src out.
    assert len(copies) == 2 + 2 + 2 * 3


def _views():
    g = torch.Generator().manual_seed(0)
    base = torch.randn(8, 5, 6, 4, generator=g)
    return {
        "transposed": base.permute(0, 3, 1, 2),  # shape (8, 4, 5, 6), not contiguous
        "sliced": base[::2, :, 1:, ::2],  # not dense
        "channels_last": base.contiguous(memory_format=CL),
        "expanded_batch": base[:1].expand(3, -1, -1, -1),  # stride 0
    }


VIEW_PATTERNS = {"channel": (1,), "spatial": (2, 3), "batch": (0,), "first_and_last": (0, 3), "all_ones": ()}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16], ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("pattern", VIEW_PATTERNS, ids=list(VIEW_PATTERNS))
@pytest.mark.parametrize("view", list(_views()))
def test_broadcast_form_on_views(view, pattern, dtype):
    x = _views()[view].to(dtype)
    kept = VIEW_PATTERNS[pattern]
    sshape = [s if d in kept else 1 for d, s in enumerate(x.shape)]
    g = torch.Generator().manual_seed(1)
    dy = torch.randn(x.shape, generator=g).to(dtype)
    gamma = (torch.rand(sshape, generator=g) + 0.5).to(stats_dtype(dtype))
    m = x.numel() // gamma.numel()

    dst, mean, var = torch_bn_grad.batch_norm_forward(x, gamma, gamma)
    ref = reference_forward(x, gamma, gamma, None, None, 1e-5, "NCX")
    assert_close(dst, ref[0], dtype)
    assert_close(mean, ref[1], torch.float64 if dtype == torch.float64 else torch.float32)
    dx, dg, db = torch_bn_grad.batch_norm_backward(x, dy, mean, var, gamma)
    ref_dx, ref_dg, ref_db = reference_backward(x, dy, mean, var, gamma, 1e-5, "NCX", True)
    assert_close(dx, ref_dx, dtype, scale=2)
    assert_close(dg, ref_dg, dtype, scale=m)
    assert_close(db, ref_db, dtype, scale=m)
    # Outputs take src's memory format (what empty_like gives).
    assert dst.stride() == dx.stride() == torch.empty_like(x).stride()


@pytest.mark.parametrize("memory_format", [CL, CL3], ids=["channels_last", "channels_last_3d"])
@pytest.mark.parametrize("form", ["1d", "channel", "spatial", "irregular"])
def test_channels_last_outputs_keep_the_format(memory_format, form):
    shape = SHAPE if memory_format == CL else SHAPE_3D
    x = torch.randn(shape).to(memory_format=memory_format)
    dy = torch.randn(shape).to(memory_format=memory_format)
    kept = {"1d": None, "channel": (1,), "spatial": tuple(range(2, len(shape))), "irregular": (0, 2)}[form]
    gamma = torch.rand(shape[1] if kept is None else [s if d in kept else 1 for d, s in enumerate(shape)])
    dst, mean, var = torch_bn_grad.batch_norm_forward(x, gamma, None)
    dx, _, _ = torch_bn_grad.batch_norm_backward(x, dy, mean, var, gamma)
    assert dst.is_contiguous(memory_format=memory_format)
    assert dx.is_contiguous(memory_format=memory_format)
    assert_close(dst, reference_forward(x, gamma, None, None, None, 1e-5, "NCX")[0], torch.float32)
    assert_close(dx, reference_backward(x, dy, mean, var, gamma, 1e-5, "NCX", True)[0], torch.float32, scale=2)


# ---------------------------------------------------------------- 64-bit indexing
# Run in a fresh process, so that its peak memory is its own. The data is 1
# everywhere except the last 2^21 elements, which lie beyond element 2^31 and
# are 3: an index that wrapped at 2^31 (or 2^32) would read 1s there.
_BIG_SCRIPT = r"""
import json, resource, sys, torch, torch_bn_grad
dtype = getattr(torch, sys.argv[1])
tail = 2 ** 21
shapes = {"NCX": (2, 2, 2 ** 29 + 2 ** 19), "NXC": (2 ** 30 + 2 ** 20, 2)}
out = {}
for fmt, shape in shapes.items():
    x = torch.ones(shape, dtype=dtype)
    x.view(-1)[-tail:] = 3
    dst, mean, var = torch_bn_grad.batch_norm_forward(x, data_format=fmt)
    flat = dst.view(-1)
    result = {"numel": x.numel(), "mean": mean.tolist(), "var": var.tolist(),
              "dst_first": flat[0].item(), "dst_tail": flat[-tail:].aminmax(),
              "dst_before_tail": flat[-tail - 1].item()}
    del dst, flat
    dx, dg, db = torch_bn_grad.batch_norm_backward(x, x, mean, var, data_format=fmt)
    flat = dx.view(-1)
    result.update(dx_first=flat[0].item(), dx_tail=flat[-tail:].aminmax(), dg=dg.tolist(), db=db.tolist())
    result["dst_tail"] = [t.item() for t in result["dst_tail"]]
    result["dx_tail"] = [t.item() for t in result["dx_tail"]]
    out[fmt] = result
    del x, dx, flat
out["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps(out))
"""


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_more_than_2_31_elements(dtype):
    proc = subprocess.run([sys.executable, "-c", _BIG_SCRIPT, dtype], capture_output=True, text=True, check=True)
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    tail, eps = 2**21, 1e-5
    element_bytes = 2
    for fmt, channel_size, tail_channels in (
        ("NCX", 2 * (2**29 + 2**19), {1: tail}),  # the tail is the end of channel 1
        ("NXC", 2**30 + 2**20, {0: tail // 2, 1: tail // 2}),  # the last rows: both channels
    ):
        r = out[fmt]
        assert r["numel"] > 2**31
        for c in (0, 1):
            p = tail_channels.get(c, 0) / channel_size
            mean, var = 1 + 2 * p, 4 * p * (1 - p)
            assert r["mean"][c] == pytest.approx(mean, rel=1e-6)
            assert r["var"][c] == pytest.approx(var, rel=1e-4, abs=1e-9)
        # The last channel's tail (3s) and its 1s normalize to these values.
        c = max(tail_channels)
        rstd = 1 / math.sqrt(r["var"][c] + eps)
        for value, got in ((3, r["dst_tail"][0]), (3, r["dst_tail"][1]), (1, r["dst_before_tail"])):
            assert got == pytest.approx((value - r["mean"][c]) * rstd, rel=1e-2)
        # diff_dst = src: diff_beta = sum(x), diff_gamma = sum(x * xhat) = M var rstd,
        # diff_src = xhat * eps / (var + eps).
        for c in (0, 1):
            assert r["db"][c] == pytest.approx(channel_size + 2 * tail_channels.get(c, 0), rel=1e-6)
            var = r["var"][c]
            assert r["dg"][c] == pytest.approx(channel_size * var / math.sqrt(var + eps), rel=1e-4, abs=1e-3)
        c = max(tail_channels)
        xhat3 = (3 - r["mean"][c]) / math.sqrt(r["var"][c] + eps)
        expected_dx3 = xhat3 * eps / (r["var"][c] + eps)
        assert r["dx_tail"] == pytest.approx([expected_dx3, expected_dx3], rel=2e-2)
    # Peak memory: src and one output at a time (no hidden copies of the data).
    tensor_bytes = (2**31 + 2**21) * element_bytes
    assert out["peak_rss_bytes"] < 2 * tensor_bytes + 2**30
