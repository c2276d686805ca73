"""The fused operators under torch.compile and torch.export: no graph breaks,
an exported eval module, and the inductor lowering (torch_bn_grad/_compile/inductor_act.py)
against the operators, bit for bit where it keeps their numerics."""

from __future__ import annotations

import pytest
import torch

from support.batch_norm_act_cases import ACTIVATIONS, EPS, SLOPE, rounded_inputs
from torch_bn_grad.functional import batch_norm_act


def test_compile_fullgraph_no_graph_breaks():
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    rm, rv = torch.zeros(4), torch.ones(4)

    def fn(x, w, b, r, training):
        y = batch_norm_act(x, rm, rv, w, b, training, residual=r, activation="silu")
        return batch_norm_act(y, rm, rv, None, None, training, activation="leaky_relu", memory_saving=True)

    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    g = torch.Generator().manual_seed(6)
    x, r = torch.randn(3, 4, 5, generator=g), torch.randn(3, 4, 5, generator=g)
    w, b = torch.rand(4, generator=g) + 0.5, torch.randn(4, generator=g)
    for training in (True, False):
        outs = []
        for run in (compiled, fn):
            inputs = [t.clone().requires_grad_() for t in (x, w, b, r)]
            out = run(*inputs, training)
            outs.append((out, *torch.autograd.grad(out.square().sum(), inputs)))
        torch.testing.assert_close(outs[0], outs[1])
    assert not counters["graph_break"]


def test_export_eval_module():
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("rm", torch.randn(4) * 0.1)
            self.register_buffer("rv", torch.rand(4) + 0.5)

        def forward(self, x, r):
            return batch_norm_act(x, self.rm, self.rv, residual=r, activation="relu")

    m = Block().eval()
    x, r = torch.randn(2, 4, 3, 3), torch.randn(2, 4, 3, 3)
    exported = torch.export.export(m, (x, r))
    torch.testing.assert_close(exported.module()(x, r), m(x, r))


@pytest.mark.parametrize("layout", ["rank3", "rank4-cl"])
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_inductor_rewrites_match_the_operators(activation, layout, monkeypatch):
    """The inductor lowering (torch_bn_grad/_compile/inductor_act.py), run eagerly on real
    tensors, gives the operators' results; it is in inductor's table. A training
    backward on CPU gates diff_dst in ATen and runs batch_norm_backward on the
    result where that gate is exact (the fused kernel's numbers, bit for bit), and
    keeps the operator otherwise (silu); the whole rewrite (taken on CUDA) is
    checked here with that rule switched off."""
    from torch_bn_grad._compile import inductor as _inductor
    from torch_bn_grad._compile import inductor_act as _inductor_act
    from torch_bn_grad._compile import lowering as _lowering

    assert _inductor.ensure_registered()
    import torch._inductor.decomposition as decomposition

    assert torch.ops.torch_bn_grad.batch_norm_act_forward.default in decomposition.decompositions
    x, r, dy, w, b, _, _ = (t.float() for t in rounded_inputs(layout, torch.float32, True))
    rewrites = _inductor_act.rewrites()
    for op, args in (
        (torch.ops.torch_bn_grad.batch_norm_act_forward.default,
         (x, w, b, None, None, r, EPS, activation, SLOPE, "NCX", False)),
    ):
        torch.testing.assert_close(rewrites[op](*args), op(*args), atol=1e-5, rtol=1e-5)
    y, m, v = torch.ops.torch_bn_grad.batch_norm_act_forward(x, w, b, None, None, r, EPS, activation, SLOPE, "NCX",
                                                             False)
    bwd = torch.ops.torch_bn_grad.batch_norm_act_backward.default
    train_args = (dy, x, y, r, m, v, w, b, EPS, activation, SLOPE, "NCX", True, False, [True] * 4)
    if activation == "silu":
        assert rewrites[bwd](*train_args) is NotImplemented
    else:
        for got, want in zip(rewrites[bwd](*train_args), bwd(*train_args)):
            assert torch.equal(got, want)
            assert got.stride() == want.stride()
    monkeypatch.setattr(_lowering, "reduces_in_kernel", lambda src, training: False)
    for training in (True, False):
        args = (dy, x, y, r, m, v, w, b, EPS, activation, SLOPE, "NCX", training, False, [True] * 4)
        torch.testing.assert_close(rewrites[bwd](*args), bwd(*args), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layout", ["rank2", "rank3", "rank4", "rank4-cl"])
def test_inductor_cpu_training_backward_rewrite_is_the_kernels_bit_for_bit(dtype, layout):
    """On CPU, the training backward's rewrite (the gate in ATen, then batch_norm_backward)
    returns the fused operator's results bit for bit, with its dtypes and strides, where the
    gate is exact; leaky_relu on half-precision data (a rounded product) stays opaque."""
    from torch_bn_grad._compile import inductor_act as _inductor_act

    shape, fmt = {"rank2": ((64, 40), torch.contiguous_format), "rank3": ((4, 16, 33), torch.contiguous_format),
                  "rank4": ((8, 24, 7, 7), torch.contiguous_format),
                  "rank4-cl": ((8, 24, 7, 7), torch.channels_last)}[layout]
    param = torch.float64 if dtype == torch.float64 else torch.float32
    g = torch.Generator().manual_seed(3)
    x, r, dy = (torch.randn(shape, generator=g).to(dtype).contiguous(memory_format=fmt) for _ in range(3))
    w, b = (torch.rand(shape[1], generator=g) + 0.5).to(param), torch.randn(shape[1], generator=g).to(param)
    bwd = torch.ops.torch_bn_grad.batch_norm_act_backward.default
    for activation in ("identity", "relu", "leaky_relu"):
        y, m, v = torch.ops.torch_bn_grad.batch_norm_act_forward(x, w, b, None, None, r, EPS, activation, SLOPE,
                                                                 "NCX", False)
        for mask in ([True] * 4, [True, False, False, True], [False, True, True, False]):
            args = (dy, x, y, r, m, v, w, b, EPS, activation, SLOPE, "NCX", True, False, mask)
            got = _inductor_act.rewrites()[bwd](*args)
            if activation == "leaky_relu" and dtype in (torch.float16, torch.bfloat16):
                assert got is NotImplemented
                continue
            for a, e in zip(got, bwd(*args)):
                assert a.dtype == e.dtype and a.shape == e.shape and torch.equal(a, e)
                assert a.numel() == 0 or a.stride() == e.stride()


def test_inductor_compile_matches_eager():
    """torch.compile with inductor (the lowering in place), training forward and backward."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    rm, rv = torch.zeros(4), torch.ones(4)

    def fn(x, w, b, r):
        return batch_norm_act(x, rm, rv, w, b, True, residual=r, activation="silu")

    compiled = torch.compile(fn, fullgraph=True)
    g = torch.Generator().manual_seed(7)
    x, r = torch.randn(3, 4, 5, 6, generator=g), torch.randn(3, 4, 5, 6, generator=g)
    w, b = torch.rand(4, generator=g) + 0.5, torch.randn(4, generator=g)
    results = []
    for run in (compiled, fn):
        inputs = [t.clone().requires_grad_() for t in (x, w, b, r)]
        y = run(*inputs)
        results.append((y, *torch.autograd.grad(y.square().sum(), inputs)))
    torch.testing.assert_close(results[0], results[1], atol=1e-5, rtol=1e-5)
    assert not counters["graph_break"]
