"""Every error of docs/api.md's rules and operators: ValueError for shapes,
ranks, data_format, epsilon and devices, TypeError for dtypes and dtype
combinations.
Each message names the argument with its expected and actual values; the
operator raises before running any ATen op (nothing allocated or written) and
leaves its inputs as they were.

Device mismatches use the 'meta' device: a meta tensor among the arguments
routes the call to the operator's fake implementation, which must raise the
same error as the C++ checks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import torch_bn_grad

F32, F64, F16, BF16 = torch.float32, torch.float64, torch.float16, torch.bfloat16


def _t(*shape: int, dtype: torch.dtype = F32, device: str = "cpu") -> torch.Tensor:
    return torch.rand(shape, dtype=torch.float64).to(dtype=dtype, device=device) + 0.5


@dataclass
class ErrorCase:
    """A call with one bad argument, the error it raises and what its message must contain."""

    name: str
    error: type
    words: list[str]  # argument name, expected value, actual value
    op: str = "backward"  # backward | forward
    args: Callable[[], tuple] = field(default=lambda: ())
    kwargs: dict = field(default_factory=dict)


def _bwd(src=None, diff_dst=None, mean=None, variance=None, gamma=None):
    """Valid backward arguments ((2, 3, 4) float32, 1-D statistics), with replacements."""
    src = _t(2, 3, 4) if src is None else src
    return (
        src,
        _t(*src.shape, dtype=src.dtype) if diff_dst is None else diff_dst,
        _t(3) if mean is None else mean,
        _t(3) if variance is None else variance,
        _t(3) if gamma is None else gamma,
    )


def _fwd(src=None, gamma=None, beta=None, mean=None, variance=None):
    return (_t(2, 3, 4) if src is None else src, gamma, beta, mean, variance)


BACKWARD = [
    # ValueError: shapes and ranks
    ErrorCase("diff_dst-shape", ValueError, ["diff_dst", "[2, 3, 4]", "[2, 3, 5]"], args=lambda: _bwd(diff_dst=_t(2, 3, 5))),
    ErrorCase("mean-length", ValueError, ["mean", "[3]", "[4]"], args=lambda: _bwd(mean=_t(4))),
    ErrorCase("variance-shape", ValueError, ["variance", "[3]", "[4]"], args=lambda: _bwd(variance=_t(4))),
    ErrorCase("gamma-shape", ValueError, ["gamma", "[3]", "[2]"], args=lambda: _bwd(gamma=_t(2))),
    ErrorCase("mean-rank", ValueError, ["mean", "rank 3", "[1, 3]"], args=lambda: _bwd(mean=_t(1, 3))),
    ErrorCase(
        "broadcast-dim",
        ValueError,
        ["mean", "1 or 3", "got 2"],
        args=lambda: _bwd(mean=_t(1, 2, 1), variance=_t(1, 2, 1), gamma=_t(1, 2, 1)),
    ),
    ErrorCase(
        "broadcast-variance-shape",
        ValueError,
        ["variance", "[1, 3, 1]", "[1, 3, 4]"],
        args=lambda: _bwd(mean=_t(1, 3, 1), variance=_t(1, 3, 4), gamma=_t(1, 3, 1)),
    ),
    ErrorCase(
        "src-rank-0",
        ValueError,
        ["src", "rank 1 to 8", "rank 0"],
        args=lambda: (_t(), _t(), _t(1), _t(1), None),
    ),
    ErrorCase(
        "src-rank-9",
        ValueError,
        ["src", "rank 1 to 8", "rank 9"],
        args=lambda: (_t(*[1] * 9), _t(*[1] * 9), _t(1), _t(1), None),
    ),
    ErrorCase(
        "rank-1-length",
        ValueError,
        ["mean", "1 or 5", "got 3"],
        args=lambda: (_t(5), _t(5), _t(3), _t(3), None),
    ),
    ErrorCase("output_mask-length", ValueError, ["output_mask", "3", "got 2"], args=_bwd, kwargs={"output_mask": (True, True)}),
    # ValueError: data_format and epsilon
    ErrorCase("data_format", ValueError, ["data_format", "'NCX' or 'NXC'", "'NHWC'"], args=_bwd, kwargs={"data_format": "NHWC"}),
    ErrorCase("data_format-type", ValueError, ["data_format", "'NCX' or 'NXC'", "None"], args=_bwd, kwargs={"data_format": None}),
    ErrorCase("epsilon-negative", ValueError, ["epsilon", ">= 0", "-0.001"], args=_bwd, kwargs={"epsilon": -1e-3}),
    ErrorCase("epsilon-nan", ValueError, ["epsilon", "finite", "nan"], args=_bwd, kwargs={"epsilon": float("nan")}),
    ErrorCase("epsilon-inf", ValueError, ["epsilon", "finite", "inf"], args=_bwd, kwargs={"epsilon": float("inf")}),
    # ValueError: devices
    ErrorCase("device-diff_dst", ValueError, ["diff_dst", "cpu", "meta"], args=lambda: _bwd(diff_dst=_t(2, 3, 4, device="meta"))),
    ErrorCase("device-mean", ValueError, ["mean", "cpu", "meta"], args=lambda: _bwd(mean=_t(3, device="meta"))),
    ErrorCase("device-variance", ValueError, ["variance", "cpu", "meta"], args=lambda: _bwd(variance=_t(3, device="meta"))),
    ErrorCase("device-gamma", ValueError, ["gamma", "cpu", "meta"], args=lambda: _bwd(gamma=_t(3, device="meta"))),
    ErrorCase("device-src", ValueError, ["src", "meta", "cpu"], args=lambda: _bwd(src=_t(2, 3, 4, device="meta"), diff_dst=_t(2, 3, 4))),
    # TypeError: dtypes and combinations
    ErrorCase(
        "src-dtype",
        TypeError,
        ["src", "torch.float32", "torch.int32"],
        args=lambda: _bwd(src=torch.ones(2, 3, 4, dtype=torch.int32)),
    ),
    ErrorCase("diff_dst-dtype", TypeError, ["diff_dst", "torch.float32", "torch.float64"], args=lambda: _bwd(diff_dst=_t(2, 3, 4, dtype=F64))),
    ErrorCase("mean-dtype", TypeError, ["mean", "torch.float32", "torch.float64"], args=lambda: _bwd(mean=_t(3, dtype=F64))),
    ErrorCase(
        "variance-dtype",
        TypeError,
        ["variance", "torch.float32", "torch.float64"],
        args=lambda: _bwd(variance=_t(3, dtype=F64)),
    ),
    ErrorCase("gamma-dtype", TypeError, ["gamma", "torch.float32", "torch.float16"], args=lambda: _bwd(gamma=_t(3, dtype=F16))),
    ErrorCase(
        "half-src-float64-stats",
        TypeError,
        ["mean", "torch.float32 or torch.float16", "torch.float64"],
        args=lambda: _bwd(src=_t(2, 3, 4, dtype=F16), mean=_t(3, dtype=F64), variance=_t(3, dtype=F64)),
    ),
    ErrorCase(
        "bfloat16-src-float16-stats",
        TypeError,
        ["mean", "torch.float32 or torch.bfloat16", "torch.float16"],
        args=lambda: _bwd(src=_t(2, 3, 4, dtype=BF16), mean=_t(3, dtype=F16), variance=_t(3, dtype=F16)),
    ),
    ErrorCase(
        "mixed-stats-dtypes",
        TypeError,
        ["variance", "mean's dtype torch.float32", "torch.float16"],
        args=lambda: _bwd(src=_t(2, 3, 4, dtype=F16), variance=_t(3, dtype=F16)),
    ),
    ErrorCase("epsilon-type", TypeError, ["epsilon", "real number", "'small'"], args=_bwd, kwargs={"epsilon": "small"}),
]

FORWARD = [
    ErrorCase("mean-without-variance", ValueError, ["mean", "variance", "mean=tensor", "variance=None"], "forward", lambda: _fwd(mean=_t(3))),
    ErrorCase("variance-without-mean", ValueError, ["mean", "variance", "mean=None", "variance=tensor"], "forward", lambda: _fwd(variance=_t(3))),
    ErrorCase("gamma-shape", ValueError, ["gamma", "[3]", "[4]"], "forward", lambda: _fwd(gamma=_t(4))),
    ErrorCase("beta-shape", ValueError, ["beta", "[1, 3, 1]", "[3]"], "forward", lambda: _fwd(gamma=_t(1, 3, 1), beta=_t(3))),
    ErrorCase(
        "variance-shape",
        ValueError,
        ["variance", "[3]", "[1, 3, 1]"],
        "forward",
        lambda: _fwd(mean=_t(3), variance=_t(1, 3, 1)),
    ),
    ErrorCase("rank-1-without-statistics", ValueError, ["src of rank 1", "(L,) or (1,)", "none"], "forward", lambda: _fwd(src=_t(5))),
    ErrorCase("src-rank-9", ValueError, ["src", "rank 1 to 8", "rank 9"], "forward", lambda: _fwd(src=_t(*[1] * 9))),
    ErrorCase("src-rank-0", ValueError, ["src", "rank 1 to 8", "rank 0"], "forward", lambda: _fwd(src=_t(), gamma=_t(1))),
    ErrorCase("data_format", ValueError, ["data_format", "'NCX' or 'NXC'", "'nchw'"], "forward", _fwd, {"data_format": "nchw"}),
    ErrorCase("epsilon-negative", ValueError, ["epsilon", ">= 0", "-1"], "forward", _fwd, {"epsilon": -1.0}),
    ErrorCase("epsilon-nan", ValueError, ["epsilon", "finite", "nan"], "forward", _fwd, {"epsilon": float("nan")}),
    ErrorCase("device-gamma", ValueError, ["gamma", "cpu", "meta"], "forward", lambda: _fwd(gamma=_t(3, device="meta"))),
    ErrorCase("device-beta", ValueError, ["beta", "cpu", "meta"], "forward", lambda: _fwd(gamma=_t(3), beta=_t(3, device="meta"))),
    ErrorCase(
        "device-variance",
        ValueError,
        ["variance", "cpu", "meta"],
        "forward",
        lambda: _fwd(mean=_t(3), variance=_t(3, device="meta")),
    ),
    ErrorCase(
        "src-dtype",
        TypeError,
        ["src", "torch.float32", "torch.complex64"],
        "forward",
        lambda: _fwd(src=torch.ones(2, 3, 4, dtype=torch.complex64)),
    ),
    ErrorCase("gamma-dtype", TypeError, ["gamma", "torch.float32", "torch.float64"], "forward", lambda: _fwd(gamma=_t(3, dtype=F64))),
    ErrorCase(
        "mixed-parameter-dtypes",
        TypeError,
        ["beta", "gamma's dtype torch.float32", "torch.bfloat16"],
        "forward",
        lambda: _fwd(src=_t(2, 3, 4, dtype=BF16), gamma=_t(3), beta=_t(3, dtype=BF16)),
    ),
]


def _call(case: ErrorCase, args: tuple):
    if case.op == "backward":
        return torch_bn_grad.batch_norm_backward(*args, **case.kwargs)
    return torch_bn_grad.batch_norm_forward(*args, **case.kwargs)


@pytest.mark.parametrize("case", BACKWARD + FORWARD, ids=[f"{c.op}-{c.name}" for c in BACKWARD + FORWARD])
def test_bad_argument_raises_a_precise_error(case):
    args = case.args()
    before = [t.clone() if isinstance(t, torch.Tensor) and t.device.type == "cpu" else t for t in args]
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with pytest.raises(case.error) as info:
            _call(case, args)
    message = str(info.value)
    assert message.startswith(f"batch_norm_{case.op}: "), message
    for word in case.words:
        assert word in message, f"{word!r} not in {message!r}"
    # Raised before anything ran: no ATen op (allocation, copy, kernel) at all.
    assert [e.name for e in prof.events() if e.name.startswith("aten::")] == []
    for t, b in zip(args, before):
        if isinstance(t, torch.Tensor) and t.device.type == "cpu":
            assert torch.equal(t, b)


def test_every_dtype_and_format_combination_that_the_contract_allows_is_accepted():
    """The complement of the TypeError cases: each allowed (src, statistics) dtype pair runs."""
    allowed = [(F64, F64), (F32, F32), (F16, F32), (F16, F16), (BF16, F32), (BF16, BF16)]
    for src_dtype, stats_dtype in allowed:
        for data_format in ("NCX", "NXC"):
            x = _t(2, 3, 3, dtype=src_dtype)
            stats = _t(3, dtype=stats_dtype)
            dst, mean, var = torch_bn_grad.batch_norm_forward(x, stats, stats, data_format=data_format)
            assert mean.dtype == (F64 if src_dtype == F64 else F32)
            grads = torch_bn_grad.batch_norm_backward(x, x, stats, stats, stats, data_format=data_format)
            assert [g.dtype for g in grads] == [src_dtype, stats_dtype, stats_dtype]
