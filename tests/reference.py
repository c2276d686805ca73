"""The float64 reference and the sample inputs shared by the tests."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Iterator, Optional

import torch
from torch import Tensor

DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
HALF_TYPES = (torch.float16, torch.bfloat16)

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


def reduced_dims(x: Tensor, data_format: str) -> list[int]:
    axis = 1 if data_format == "NCX" else x.dim() - 1
    return [d for d in range(x.dim()) if d != axis]


def per_channel_view(t: Tensor, x: Tensor, data_format: str) -> Tensor:
    shape = [1] * x.dim()
    shape[1 if data_format == "NCX" else x.dim() - 1] = -1
    return t.reshape(shape)


def reference_forward(x, gamma, beta, mean, var, eps, data_format):
    """float64 batch norm; returns (dst, mean, var) like batch_norm_forward."""
    x = x.double()
    dims = reduced_dims(x, data_format)
    if mean is None:
        var_, mean_ = torch.var_mean(x, dim=dims, correction=0)
    else:
        mean_, var_ = mean.double(), var.double()
    bc = lambda t: per_channel_view(t, x, data_format)  # noqa: E731
    dst = (x - bc(mean_)) / torch.sqrt(bc(var_) + eps)
    if gamma is not None:
        dst = dst * bc(gamma.double())
    if beta is not None:
        dst = dst + bc(beta.double())
    return dst, mean_, var_


def reference_backward(x, dy, mean, var, gamma, eps, data_format, training):
    """float64 autograd of the normalization, with the given statistics.

    Training mode differentiates through the batch statistics of x (which must
    be what `mean`/`var` are); frozen mode treats them as constants.
    """
    x = x.double().detach().requires_grad_()
    g = gamma.double().detach().requires_grad_() if gamma is not None else None
    b = torch.zeros_like(mean, dtype=torch.float64).requires_grad_()
    if training:
        dst, _, _ = reference_forward(x, g, b, None, None, eps, data_format)
    else:
        dst, _, _ = reference_forward(x, g, b, mean, var, eps, data_format)
    inputs = [x, b] + ([g] if g is not None else [])
    grads = torch.autograd.grad(dst, inputs, dy.double())
    dx, db = grads[0], grads[1]
    dg = grads[2] if g is not None else reference_diff_gamma(x, dy, mean, var, eps, data_format)
    return dx, dg, db


def reference_diff_gamma(x, dy, mean, var, eps, data_format):
    """sum(dy * xhat) per channel, in float64."""
    x, dy = x.double().detach(), dy.double()
    bc = lambda t: per_channel_view(t, x, data_format)  # noqa: E731
    xhat = (x - bc(mean.double())) / torch.sqrt(bc(var.double()) + eps)
    return (dy * xhat).sum(reduced_dims(x, data_format))


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

    def make(self, generator: torch.Generator, scale: float = 1.0, offset: float = 0.0) -> Tensor:
        """A tensor of this case's shape, dtype and memory layout."""
        if self.layout == "transposed":
            t = torch.randn(tuple(reversed(self.shape)), generator=generator, dtype=torch.float64)
            t = t.permute(*reversed(range(len(self.shape))))
        else:
            t = torch.randn(self.shape, generator=generator, dtype=torch.float64)
        t = t * scale + offset
        if self.layout == "channels_last":
            fmt = torch.channels_last if len(self.shape) == 4 else torch.channels_last_3d
            return t.to(dtype=self.dtype, memory_format=fmt)
        if self.layout == "sliced":
            return _sliced_copy(t, self.dtype)
        return t.to(self.dtype)  # keeps a transposed layout's strides

    def params(self, generator: torch.Generator):
        """(gamma, beta, running mean, running var) of the parameter dtype."""
        c, dt = self.channels, stats_dtype(self.dtype)
        gamma = (torch.rand(c, generator=generator, dtype=torch.float64) + 0.5).to(dt)
        beta = torch.randn(c, generator=generator, dtype=torch.float64).to(dt)
        mean = (torch.randn(c, generator=generator, dtype=torch.float64) * 0.1).to(dt)
        var = (torch.rand(c, generator=generator, dtype=torch.float64) + 0.5).to(dt)
        return gamma, beta, mean, var


def _sliced_copy(t: Tensor, dtype: torch.dtype) -> Tensor:
    """`t` as every other element of a larger buffer (not dense)."""
    big = torch.empty(*t.shape[:-1], t.shape[-1] * 2, dtype=dtype)
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


def assert_close(actual: Optional[Tensor], expected: Tensor, dtype: torch.dtype, scale: float = 1.0) -> None:
    """Compare against the float64 reference with `dtype`'s tolerance, scaled."""
    assert actual is not None
    tol = TOLERANCES[dtype]
    torch.testing.assert_close(
        actual.double(), expected.double(), atol=tol["atol"] * scale, rtol=tol["rtol"], check_dtype=False
    )
