"""The fused forward's sign bits of dst (``batch_norm_act_forward_sign_bits``),
which the relu / leaky_relu backward reads instead of dst on CPU: the bits, the
gradients they give (bitwise those read from dst), which ISA and layout path
wrote them, and when the autograd formula uses them."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

import torch_bn_grad
from support.isa_runs import run_on_every_isa
from torch_bn_grad.functional import batch_norm_act

EPS = 1e-5
SLOPE = 0.1
SIGN_BITS = torch.ops.torch_bn_grad.batch_norm_act_forward_sign_bits.default
FORWARD = torch.ops.torch_bn_grad.batch_norm_act_forward.default

# Layouts where the forward writes the bits (float32 and half precision, every
# ISA): lines (plane rows, or rows of channels) of a multiple of 8 elements,
# rows of one chunk or less, partial last chunks, scalar tails, and short
# planes of other sizes in tensors of 4 MB or more, whose lines share bytes
# (21x21, 14x14: threads take units of 8 or 2 planes; 6005 planes of 21x21,
# the last unit cut short)...
UNALIGNED = [((5, 1201, 21, 21), False), ((32, 400, 14, 14), False)]
FIT = [
    ((2, 24, 28, 28), False), ((1, 2, 256, 256), False), ((5, 40), False), ((600, 24), False), ((3, 20, 200), False),
    ((4, 16, 7, 7), True), ((8, 64, 4, 4), True), ((3, 1104, 2, 2), True), *UNALIGNED,
]
# ... and where it returns no bits: rows of channels not a multiple of 8,
# planes that are not a multiple of 8 in smaller tensors (where reading dst is
# faster) or walked block by block (150x150: lines share bytes across threads).
NO_FIT = [((3, 13, 5, 5), True), ((2, 20, 3, 3, 3), True), ((40, 21), False), ((4, 16, 7, 7), False),
          ((4, 16, 14, 14), False), ((3, 13, 5, 5), False), ((2, 3, 150, 150), False)]
SHAPES = FIT + NO_FIT


def _kernel_lines(t: torch.Tensor, channels_last: bool) -> torch.Tensor:
    """The CPU kernels' element order cut into its lines: plane rows, or rows of
    channels where the channels are innermost (channels_last, or (N, C))."""
    if channels_last or t.dim() == 2:
        return t.movedim(1, -1).reshape(-1, t.shape[1])
    return t.reshape(-1, t[0, 0].numel())


def _packed(y: torch.Tensor, channels_last: bool) -> np.ndarray:
    """The reference bits: y > 0, one bit an element in the kernels' order (the last byte padded with zeros)."""
    return np.packbits((_kernel_lines(y, channels_last) > 0).numpy().reshape(-1), bitorder="little")


def _case(shape, channels_last, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    fmt = {4: torch.channels_last, 5: torch.channels_last_3d}.get(len(shape), torch.contiguous_format)
    x = torch.randn(shape, generator=g).to(dtype)
    if channels_last:
        x = x.contiguous(memory_format=fmt)
    r = torch.randn(shape, generator=g).to(dtype)
    pdt = torch.float64 if dtype == torch.float64 else torch.float32
    w = torch.rand(shape[1], generator=g, dtype=pdt) + 0.5
    b = torch.randn(shape[1], generator=g, dtype=pdt)
    return x, r, w, b


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64],
                         ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("activation", ["relu", "leaky_relu"])
def test_bits_are_dst_positive_and_gradients_equal_those_from_dst(activation, dtype):
    for (shape, channels_last), with_residual, frozen in itertools.product(SHAPES, (False, True), (False, True)):
        x, r, w, b = _case(shape, channels_last, dtype)
        res = r if with_residual else None
        m = torch.randn_like(w) if frozen else None
        v = torch.rand_like(w) + 0.5 if frozen else None
        y, mean, var, bits = SIGN_BITS(x, w, b, m, v, res, EPS, activation, SLOPE, "NCX")
        y_plain, _, _ = FORWARD(x, w, b, m, v, res, EPS, activation, SLOPE, "NCX", False)
        assert torch.equal(y, y_plain)
        assert bits.dtype == torch.uint8
        if (shape, channels_last) in NO_FIT or (dtype == torch.float64 and bits.numel() == 0):
            assert bits.shape == (0,)  # float64 fits only where a vector holds 8 (AVX512)
            continue
        np.testing.assert_array_equal(bits.numpy(), _packed(y, channels_last), err_msg=f"{shape} {channels_last}")
        dy = torch.randn_like(x)
        for mask in [(True, True, True, True), (True, False, False, False), (False, True, True, False),
                     (False, False, False, True)]:
            kw = dict(src=x, residual=res, activation=activation, negative_slope=SLOPE, training=not frozen,
                      output_mask=mask)
            from_dst = torch_bn_grad.batch_norm_act_backward(dy, mean, var, w, b, dst=y, **kw)
            from_bits = torch_bn_grad.batch_norm_act_backward(dy, mean, var, w, b, dst_positive=bits, **kw)
            for a, c in zip(from_dst, from_bits):
                assert (a is None) == (c is None)
                if a is not None:
                    assert torch.equal(a, c), f"{shape} {channels_last} {mask}"


def test_bits_of_rounded_output():
    """The bits are those of the stored half-precision dst: values that round to 0 give 0."""
    # z = 1e-9 * x: positive, but below float16's smallest subnormal except for x = 40 and 100.
    x = torch.tensor([[-1.0, 1.0, 2.0, 40.0, -3.0, 5.0, 0.0, 100.0]]).t().contiguous().half()
    w, b = torch.full((1,), 1e-9), torch.zeros(1)
    mean, var = torch.zeros(1), torch.full((1,), 1.0 - EPS)
    y, _, _, bits = SIGN_BITS(x, w, b, mean, var, None, EPS, "relu", 0.0, "NCX")
    assert (y.flatten() > 0).tolist() == [False, False, False, True, False, False, False, True]
    # One channel of 8: the kernels see it as one line of 8 elements, one byte.
    np.testing.assert_array_equal(bits.numpy(), np.packbits((y.flatten() > 0).numpy(), bitorder="little"))


_ISA_SCRIPT = r"""
import json, numpy as np, torch, torch_bn_grad
ops = torch.ops.torch_bn_grad
g = torch.Generator().manual_seed(0)
ok = []
def packed(y, cl):
    lines = (y.movedim(1, -1).reshape(-1, y.shape[1]) if cl or y.dim() == 2 else y.reshape(-1, y[0, 0].numel())) > 0
    return np.packbits(lines.numpy().reshape(-1), bitorder="little")
for shape, cl in [((2, 24, 28, 28), False), ((4, 16, 7, 7), True), ((8, 64, 4, 4), True), ((300, 40), False),
                  ((4, 1200, 21, 21), False)]:
    for dt in (torch.float32, torch.bfloat16, torch.float64):
        x = torch.randn(shape, generator=g).to(dt)
        if cl:
            x = x.contiguous(memory_format=torch.channels_last)
        w = torch.rand(shape[1], generator=g, dtype=torch.float64 if dt == torch.float64 else torch.float32) + 0.5
        b = torch.randn(shape[1], generator=g, dtype=w.dtype)
        y, m, v, bits = ops.batch_norm_act_forward_sign_bits(x, w, b, None, None, None, 1e-5, "leaky_relu", 0.1, "NCX")
        if bits.numel() == 0:
            ok.append(dt == torch.float64)  # float64 bits need 8 lanes a vector (AVX512)
            continue
        same_bits = np.array_equal(bits.numpy(), packed(y, cl))
        dy = torch.randn(shape, generator=g).to(dt)
        a = torch_bn_grad.batch_norm_act_backward(dy, m, v, w, b, src=x, dst=y, activation="leaky_relu",
                                                  negative_slope=0.1)
        c = torch_bn_grad.batch_norm_act_backward(dy, m, v, w, b, src=x, dst_positive=bits, activation="leaky_relu",
                                                  negative_slope=0.1)
        ok.append(same_bits and all(torch.equal(p, q) for p, q in zip(a, c)))
print(json.dumps({"isa": torch_bn_grad.cpu_kernel_isa(), "ok": ok}))
"""


def test_every_isa_writes_and_reads_the_same_bits():
    for isa, out in run_on_every_isa(_ISA_SCRIPT).items():
        assert all(out["ok"]), (isa, out["ok"])


def _saved_tensors(fn):
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, saved


@pytest.mark.parametrize("activation,memory_saving,shape,channels_last,uses_bits", [
    ("relu", False, (4, 8, 6, 6), True, True), ("leaky_relu", False, (4, 8, 6, 6), True, True),
    ("relu", False, (4, 6, 6, 6), True, False),  # rows of 6 channels: not a multiple of 8
    ("relu", False, (4, 6, 6, 6), False, False),  # planes of 36 in a small tensor
    ("relu", False, (2, 1200, 21, 21), False, True),  # short planes of 441 (4.2 MB)
    ("relu", False, (1, 2, 150, 150), False, False),  # planes of 22500, walked block by block
    ("silu", False, (4, 8, 6, 6), True, False), ("identity", False, (4, 8, 6, 6), True, False),
    ("leaky_relu", True, (4, 8, 6, 6), True, False),
])
def test_autograd_saves_the_bits_for_relu_in_eager(activation, memory_saving, shape, channels_last, uses_bits):
    x, r, w, b = _case(shape, channels_last, torch.float32)
    x.requires_grad_()
    w.requires_grad_()
    y, saved = _saved_tensors(lambda: batch_norm_act(x, None, None, w, b, True, 0.1, EPS, residual=r,
                                                     activation=activation, negative_slope=SLOPE,
                                                     memory_saving=memory_saving))
    bits = [t for t in saved if t.dtype == torch.uint8]
    # Saved whenever relu / leaky_relu run eagerly on CPU; empty where the layout does not fit.
    assert len(bits) == (1 if activation in ("relu", "leaky_relu") and not memory_saving else 0)
    expected = _packed(y.detach(), channels_last).size
    assert sum(t.numel() == expected for t in bits) == (1 if uses_bits else 0)
    dy = torch.randn_like(y)
    got = torch.autograd.grad(y, (x, w), dy)
    x64 = x.detach().double().requires_grad_()
    w64 = w.detach().double().requires_grad_()
    z = torch.nn.functional.batch_norm(x64, None, None, w64, b.double(), True, 0.1, EPS) + r.double()
    ref_y = {"relu": torch.relu, "leaky_relu": lambda t: torch.nn.functional.leaky_relu(t, SLOPE),
             "silu": torch.nn.functional.silu, "identity": lambda t: t}[activation](z)
    ref = torch.autograd.grad(ref_y, (x64, w64), dy.double())
    for a, e in zip(got, ref):
        torch.testing.assert_close(a.double(), e, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("activation", ["relu", "leaky_relu"])
def test_sign_bits_operator_is_differentiable(activation):
    """The sign-bits forward has the forward's autograd formula (it saves and reads its own bits)."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(4, 8, 2, 4, generator=g, dtype=torch.float64).requires_grad_()
    w = (torch.rand(8, generator=g, dtype=torch.float64) + 0.5).requires_grad_()
    b = torch.randn(8, generator=g, dtype=torch.float64).requires_grad_()
    r = torch.randn(4, 8, 2, 4, generator=g, dtype=torch.float64).requires_grad_()

    def fn(x, w, b, r):
        y, mean, var, bits = SIGN_BITS(x, w, b, None, None, r, EPS, activation, SLOPE, "NCX")
        assert not bits.requires_grad
        return y, mean, var

    assert torch.autograd.gradcheck(fn, (x, w, b, r))


def test_traced_graphs_keep_the_plain_forward():
    """make_fx (a dispatch mode, as inside torch.compile / export) records batch_norm_act_forward (the eager
    step's .update overload), not the bits."""
    from torch.fx.experimental.proxy_tensor import make_fx

    x, r, w, b = _case((4, 8, 4, 4), False, torch.float32)

    def step(x, w):
        y = batch_norm_act(x, None, None, w, b, True, 0.1, EPS, activation="relu")
        return torch.autograd.grad(y, (x, w), torch.ones_like(y))

    graph = make_fx(step)(x.requires_grad_(), w.requires_grad_())
    targets = {str(n.target) for n in graph.graph.nodes if n.op == "call_function"}
    assert "torch_bn_grad.batch_norm_act_forward.update" in targets
    assert not any("sign_bits" in t for t in targets)
    assert "torch_bn_grad.batch_norm_act_backward.default" in targets


def test_opcheck():
    x, r, w, b = _case((4, 16, 5, 6), True, torch.bfloat16, seed=3)
    torch.library.opcheck(SIGN_BITS, (x, w, b, None, None, r, EPS, "relu", SLOPE, "NCX"))
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    torch.library.opcheck(SIGN_BITS, (xg, wg, b, None, None, r, EPS, "leaky_relu", SLOPE, "NCX"))
    y, m, v, bits = SIGN_BITS(x, w, b, None, None, r, EPS, "relu", SLOPE, "NCX")
    bwd = torch.ops.torch_bn_grad.batch_norm_act_backward.default
    dy = torch.randn_like(x)
    torch.library.opcheck(bwd, (dy, x, None, None, m, v, w, b, EPS, "relu", SLOPE, "NCX", True, False,
                                [True, True, True, True], bits))


@pytest.mark.parametrize("change,error,match", [
    (lambda k: dict(k, dst_positive=k["dst_positive"].to(torch.int32)), TypeError, "dst_positive must have dtype"),
    (lambda k: dict(k, dst_positive=k["dst_positive"][1:]), ValueError, "dst_positive must be a contiguous 1-D"),
    (lambda k: dict(k, dst_positive=k["dst_positive"][:0]), ValueError, "dst must be given"),
    (lambda k: dict(k, activation="silu"), ValueError, "dst_positive is read for activation 'relu'"),
    (lambda k: dict(k, activation="leaky_relu", from_output=True, dst=k["src"]), ValueError,
     "dst_positive is read for activation"),
])
def test_errors_name_dst_positive(change, error, match):
    x, r, w, b = _case((4, 8, 4, 4), False, torch.float32)
    y, m, v, bits = SIGN_BITS(x, w, b, None, None, None, EPS, "relu", SLOPE, "NCX")
    kwargs = dict(src=x, dst_positive=bits, activation="relu", beta=b)
    with pytest.raises(error, match=match):
        torch_bn_grad.batch_norm_act_backward(torch.randn_like(x), m, v, w, **change(kwargs))
