"""The float64 reference and the sample inputs shared by the tests."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

import torch
from torch import Tensor

DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
HALF_TYPES = (torch.float16, torch.bfloat16)

# The devices that device-generic tests run on (the `device` fixture, conftest.py):
# CUDA is added only where it is available, so a CPU-only run generates no CUDA cases.
DEVICES = ("cpu",) + (("cuda",) if torch.cuda.is_available() else ())

# Tolerances of a result in `dtype` against the float64 reference (outputs are O(1)).
TOLERANCES = {
    torch.float64: dict(atol=1e-10, rtol=1e-10),
    torch.float32: dict(atol=5e-5, rtol=5e-5),
    torch.float16: dict(atol=5e-3, rtol=5e-3),
    torch.bfloat16: dict(atol=4e-2, rtol=4e-2),
}


def stats_dtype(dtype: torch.dtype) -> torch.dtype:
    """Statistics and parameter dtype used with `dtype` data."""
    return torch.float32 if dtype in HALF_TYPES else dtype


def broadcast_shape(x: Tensor, data_format: str, stats_shape: Optional[Sequence[int]] = None) -> list[int]:
    """Shape in which the per-channel tensors broadcast against `x`.

    `stats_shape` itself in the DirectML broadcast form (statistics of x's
    rank); otherwise 1 everywhere but the channel axis that `data_format` picks.
    """
    if stats_shape is not None and len(stats_shape) == x.dim():
        return list(stats_shape)
    axis = 1 if data_format == "NCX" else x.dim() - 1
    shape = [1] * x.dim()
    shape[axis] = x.shape[axis]
    return shape


def reduced_dims(x: Tensor, data_format: str, stats_shape: Optional[Sequence[int]] = None) -> list[int]:
    """The dims each channel reduces over: those where the broadcast shape is 1."""
    return [d for d, s in enumerate(broadcast_shape(x, data_format, stats_shape)) if s == 1]


def _sum(t: Tensor, dims: Sequence[int]) -> Tensor:
    """Sum over `dims`, kept as size-1 dims; nothing to reduce leaves `t` as is."""
    return t.sum(dim=list(dims), keepdim=True) if dims else t


def _count(x: Tensor, dims: Sequence[int]) -> int:
    return math.prod(x.shape[d] for d in dims)


def reference_forward(x, gamma, beta, mean, var, eps, data_format):
    """float64 batch norm; returns (dst, mean, var) like batch_norm_forward.

    The per-channel tensors are 1-D of length C (axis from `data_format`) or,
    in the broadcast form, of x's rank; the first one given fixes the form.
    """
    x = x.double()
    given = next((t for t in (mean, var, gamma, beta) if t is not None), None)
    stats_shape = list(given.shape) if given is not None else None
    shape = broadcast_shape(x, data_format, stats_shape)
    out_shape = stats_shape if stats_shape is not None else [x.shape[1 if data_format == "NCX" else -1]]
    dims = reduced_dims(x, data_format, stats_shape)
    bc = lambda t: t.double().reshape(shape)  # noqa: E731
    if mean is None:
        m = _count(x, dims)
        mean_ = _sum(x, dims) / m
        var_ = _sum((x - mean_) ** 2, dims) / m
    else:
        mean_, var_ = bc(mean), bc(var)
    dst = (x - mean_) / torch.sqrt(var_ + eps)
    if gamma is not None:
        dst = dst * bc(gamma)
    if beta is not None:
        dst = dst + bc(beta)
    return dst, mean_.reshape(out_shape), var_.reshape(out_shape)


def reference_backward(x, dy, mean, var, gamma, eps, data_format, training):
    """The contract's gradients (docs/api.md, Notation) in float64, with the given statistics.

    Training mode is the full gradient through batch statistics (of which
    `mean`/`var` are the values); frozen mode treats them as constants.
    """
    x, dy = x.double(), dy.double()
    shape = broadcast_shape(x, data_format, list(mean.shape))
    dims = reduced_dims(x, data_format, list(mean.shape))
    m = _count(x, dims)
    bc = lambda t: t.double().reshape(shape)  # noqa: E731
    rstd = 1 / torch.sqrt(bc(var) + eps)
    xhat = (x - bc(mean)) * rstd
    g = bc(gamma) if gamma is not None else 1.0
    diff_beta = _sum(dy, dims)
    diff_gamma = _sum(dy * xhat, dims)
    if training and m > 0:
        diff_src = g * rstd * (dy - diff_beta / m - xhat * diff_gamma / m)
    else:
        diff_src = g * rstd * dy
    return diff_src, diff_gamma.reshape(mean.shape), diff_beta.reshape(mean.shape)


@dataclass
class Case:
    """One sample: data of some shape, dtype, data format and memory layout."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    data_format: str
    layout: str  # contiguous | channels_last | transposed | sliced

    @property
    def channels(self) -> int:
        return self.shape[1] if self.data_format == "NCX" else self.shape[-1]

    def __str__(self) -> str:
        return f"{self.shape}-{str(self.dtype)[6:]}-{self.data_format}-{self.layout}"

    def make(
        self, generator: torch.Generator, scale: float = 1.0, offset: float = 0.0, device: str = "cpu"
    ) -> Tensor:
        """A tensor of this case's shape, dtype and memory layout on `device`.

        The values are drawn on the CPU, so they are the same on every device.
        """
        if self.layout == "transposed":
            t = torch.randn(tuple(reversed(self.shape)), generator=generator, dtype=torch.float64)
            t = t.permute(*reversed(range(len(self.shape))))
        else:
            t = torch.randn(self.shape, generator=generator, dtype=torch.float64)
        t = t * scale + offset
        if self.layout == "channels_last":
            fmt = torch.channels_last if len(self.shape) == 4 else torch.channels_last_3d
            return t.to(device=device, dtype=self.dtype, memory_format=fmt)
        if self.layout == "sliced":
            return _sliced_copy(t, self.dtype, device)
        return t.to(device=device, dtype=self.dtype)  # keeps a transposed layout's strides

    def params(self, generator: torch.Generator, device: str = "cpu"):
        """(gamma, beta, running mean, running var) of the parameter dtype, on `device`."""
        c, dt = self.channels, stats_dtype(self.dtype)
        gamma = torch.rand(c, generator=generator, dtype=torch.float64) + 0.5
        beta = torch.randn(c, generator=generator, dtype=torch.float64)
        mean = torch.randn(c, generator=generator, dtype=torch.float64) * 0.1
        var = torch.rand(c, generator=generator, dtype=torch.float64) + 0.5
        return tuple(t.to(device=device, dtype=dt) for t in (gamma, beta, mean, var))


def _sliced_copy(t: Tensor, dtype: torch.dtype, device: str) -> Tensor:
    """`t` as every other element of a larger buffer on `device` (not dense)."""
    big = torch.empty(*t.shape[:-1], t.shape[-1] * 2, dtype=dtype, device=device)
    view = big[..., ::2]
    view.copy_(t)
    return view


SHAPES = {2: (6, 5), 3: (3, 4, 7), 4: (2, 3, 5, 4), 5: (2, 3, 2, 3, 4)}


def cases(dtypes=DTYPES) -> Iterator[Case]:
    """Every dtype, data format, rank 2 to 5 and memory layout of the contract."""
    for dtype, fmt, (rank, shape) in itertools.product(dtypes, ("NCX", "NXC"), SHAPES.items()):
        layouts = ["contiguous", "transposed", "sliced"]
        if fmt == "NCX" and rank in (4, 5):
            layouts.append("channels_last")
        for layout in layouts:
            yield Case(shape, dtype, fmt, layout)


def normalization_inputs(shape: Sequence[int], dtype: torch.dtype, layout: str, seed: int, scale: float = 1.0,
                         offset: float = 0.0) -> tuple[Tensor, Tensor, Tensor]:
    """(x, gamma, beta) for a 4-D NCX case: x = randn * scale + offset in `dtype` and
    `layout` ("contiguous" or "channels_last"), gamma and beta of the parameter dtype."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(*shape, generator=g) * scale + offset).to(dtype)
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    channels = shape[1]
    gamma = (torch.rand(channels, generator=g) + 0.5).to(stats_dtype(dtype))
    beta = torch.randn(channels, generator=g).to(stats_dtype(dtype))
    return x, gamma, beta


def assert_close(actual: Optional[Tensor], expected: Tensor, dtype: torch.dtype, scale: float = 1.0) -> None:
    """Compare against the float64 reference with `dtype`'s tolerance, scaled."""
    assert actual is not None
    tol = TOLERANCES[dtype]
    torch.testing.assert_close(
        actual.double(), expected.double(), atol=tol["atol"] * scale, rtol=tol["rtol"], check_dtype=False
    )


def assert_modules_match(ref: torch.nn.Module, ours: torch.nn.Module, x: Tensor) -> None:
    """Same output and same input gradient (of the output's sum) for the same input."""
    xr, xo = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_r, out_o = ref(xr), ours(xo)
    torch.testing.assert_close(out_o, out_r)
    out_r.sum().backward()
    out_o.sum().backward()
    torch.testing.assert_close(xo.grad, xr.grad)
