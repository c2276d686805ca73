"""Forward-mode AD: torch.func.jvp, jacfwd, hessian and torch.autograd.forward_ad
through the operators, the functional API, the fused operators and the modules,
against the float64 reference composites (tests/support/reference.py) and torch's own
batch norm; tangents of tangents (jacrev of jacfwd, hessian = jacfwd of jacrev)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F

import torch_bn_grad
from support.reference import HALF_TYPES, assert_close, cases, reference_backward, reference_forward, stats_dtype
from support.batch_norm_act_cases import ACTIVATIONS, torch_activation  # leaky_relu's slope 0.2
from torch_bn_grad import functional as BF

FORWARD = torch.ops.torch_bn_grad.batch_norm_forward.default
BACKWARD = torch.ops.torch_bn_grad.batch_norm_backward.default
ACT_FORWARD = torch.ops.torch_bn_grad.batch_norm_act_forward.default
EPS = 1e-5
# One case per data format, rank and layout, float64 (the formulas' exactness) and float32.
CASES = [c for c in cases((torch.float64, torch.float32))]


def _tangents(args, g):
    """A random, non-uniform tangent for every tensor argument."""
    return tuple(torch.randn(a.shape, generator=g, dtype=torch.float64).to(a.dtype) for a in args)


def _forward_args(case, training, g, broadcast=False):
    x = case.make(g)
    gamma, beta, mean, var = case.params(g)
    if broadcast:  # the DirectML form: statistics of x's rank
        shape = [1] * x.dim()
        axis = 1 if case.data_format == "NCX" else x.dim() - 1
        shape[axis] = case.channels
        gamma, beta, mean, var = (t.reshape(shape) for t in (gamma, beta, mean, var))
    return (x, gamma, beta) if training else (x, gamma, beta, mean, var)


@pytest.mark.parametrize("training", [True, False], ids=["train", "frozen"])
@pytest.mark.parametrize("broadcast", [False, True], ids=["1d", "broadcast"])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_forward_operator_jvp_matches_reference(case, training, broadcast):
    g = torch.Generator().manual_seed(0)
    args = _forward_args(case, training, g, broadcast)
    fmt = case.data_format

    def ours(x, gamma, beta, mean=None, var=None):
        return FORWARD(x, gamma, beta, mean, var, EPS, fmt)

    def ref(x, gamma, beta, mean=None, var=None):
        return reference_forward(x.double(), gamma.double(), beta.double(), None if mean is None else mean.double(),
                                 None if var is None else var.double(), EPS, fmt)

    tangents = _tangents(args, g)
    outs, t_ours = torch.func.jvp(ours, args, tangents)
    _, t_ref = torch.func.jvp(ref, tuple(a.double() for a in args), tuple(t.double() for t in tangents))
    for t, r, out in zip(t_ours, t_ref, outs):
        assert t.dtype == out.dtype and t.shape == out.shape
        assert_close(t, r.reshape(t.shape), case.dtype, scale=10)


@pytest.mark.parametrize("dtype", HALF_TYPES, ids=str)
@pytest.mark.parametrize("training", [True, False], ids=["train", "frozen"])
def test_half_precision_tangents(dtype, training):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 3, 5, 6, generator=g).to(dtype).contiguous(memory_format=torch.channels_last)
    w, b, rm, rv = torch.rand(3, generator=g) + 0.5, torch.randn(3, generator=g), torch.randn(3, generator=g), \
        torch.rand(3, generator=g) + 0.5
    tx = torch.randn(x.shape, generator=g).to(dtype)
    f = lambda x: BF.batch_norm(x, None if training else rm, None if training else rv, w, b, training=training)  # noqa: E731
    ref = lambda x: F.batch_norm(x, None if training else rm.double(), None if training else rv.double(),  # noqa: E731
                                 w.double(), b.double(), training=training)
    y, t = torch.func.jvp(f, (x,), (tx,))
    _, t_ref = torch.func.jvp(ref, (x.double(),), (tx.double(),))
    assert t.dtype == dtype
    assert_close(t, t_ref, dtype, scale=4)


@pytest.mark.parametrize("training", [True, False], ids=["train", "frozen"])
@pytest.mark.parametrize("case", [c for c in CASES if c.dtype == torch.float64], ids=str)
def test_backward_operator_jvp_matches_reference(case, training):
    """Forward over reverse runs the backward operator's jvp: every input's tangent."""
    g = torch.Generator().manual_seed(2)
    x, dy = case.make(g), case.make(g)
    gamma, _, mean, var = case.params(g)
    fmt = case.data_format
    args = (x, dy, mean, var, gamma)
    tangents = _tangents(args, g)
    for mask in ([True, True, True], [True, False, True], [False, True, False]):
        _, t_ours = torch.func.jvp(lambda *a: BACKWARD(*a, EPS, fmt, training, mask), args, tangents)
        _, t_ref = torch.func.jvp(lambda *a: reference_backward(*a, EPS, fmt, training), args, tangents)
        for wanted, t, r in zip(mask, t_ours, t_ref):
            if wanted:
                assert_close(t, r.reshape(t.shape), torch.float64)
            else:
                assert t.numel() == 0


def _mlp(batch_norm, params, x):
    """Linear-BN(batch statistics)-tanh-Linear, with the given batch_norm."""
    h = batch_norm(x @ params["w1"].T, None, None, params["gamma"], params["beta"], training=True)
    return torch.tanh(h) @ params["w2"].T


def _mlp_params(g):
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    return {"w1": r(4, 3), "gamma": r(4).abs() + 0.5, "beta": r(4), "w2": r(2, 4)}


def test_jacfwd_hessian_and_mixed_orders_match_torch():
    g = torch.Generator().manual_seed(3)
    params, x = _mlp_params(g), torch.randn(6, 3, dtype=torch.float64, generator=g)
    ours = lambda p, x: _mlp(BF.batch_norm, p, x)  # noqa: E731
    theirs = lambda p, x: _mlp(F.batch_norm, p, x)  # noqa: E731
    torch.testing.assert_close(torch.func.jacfwd(ours, argnums=(0, 1))(params, x),
                               torch.func.jacfwd(theirs, argnums=(0, 1))(params, x))
    loss = lambda f: (lambda x: (f(params, x) ** 3).sum())  # noqa: E731
    expected = torch.func.hessian(loss(theirs))(x)
    torch.testing.assert_close(torch.func.hessian(loss(ours))(x), expected)  # forward over reverse
    torch.testing.assert_close(torch.func.jacrev(torch.func.jacfwd(loss(ours)))(x), expected)  # reverse over forward
    torch.testing.assert_close(torch.func.jacfwd(torch.func.jacfwd(loss(ours)))(x), expected)  # forward over forward


def test_dual_tensors_of_forward_ad():
    g = torch.Generator().manual_seed(4)
    x, tx = (torch.randn(5, 3, 4, generator=g, dtype=torch.float64) for _ in range(2))
    w, tw = torch.rand(3, generator=g, dtype=torch.float64) + 0.5, torch.randn(3, generator=g, dtype=torch.float64)
    results = []
    for bn in (BF.batch_norm, F.batch_norm):
        with fwAD.dual_level():
            y = bn(fwAD.make_dual(x, tx), None, None, fwAD.make_dual(w, tw), None, training=True)
            results.append(fwAD.unpack_dual(y))
    torch.testing.assert_close(results[0].primal, results[1].primal)
    torch.testing.assert_close(results[0].tangent, results[1].tangent)


# memory_saving needs an invertible activation.
FUSED_MODES = [(a, False) for a in ACTIVATIONS] + [("identity", True), ("leaky_relu", True)]


@pytest.mark.parametrize("training", [True, False], ids=["train", "frozen"])
@pytest.mark.parametrize("activation,memory_saving", FUSED_MODES, ids=lambda v: str(v))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_fused_jvp_matches_torch_composition(activation, training, memory_saving, dtype):
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(4, 6, 3, 5, generator=g, dtype=torch.float64) * 2).to(dtype)
    x = x.contiguous(memory_format=torch.channels_last)
    r = torch.randn(x.shape, generator=g, dtype=torch.float64).to(dtype)
    pd = stats_dtype(dtype)
    w, b = torch.rand(6, generator=g, dtype=pd) + 0.5, torch.randn(6, generator=g, dtype=pd)
    rm, rv = torch.randn(6, generator=g, dtype=pd), torch.rand(6, generator=g, dtype=pd) + 0.5
    stats = (None, None) if training else (rm, rv)

    def ours(x, w, b, r):
        return ACT_FORWARD(x, w, b, *stats, r, EPS, activation, 0.2, "NCX", memory_saving)[0]

    def theirs(x, w, b, r):
        z = F.batch_norm(x.double(), *(None if s is None else s.double() for s in stats), w.double(), b.double(),
                         training, 0.1, EPS)
        return torch_activation(z + r.double(), activation)

    args = (x, w, b, r)
    tangents = _tangents(args, g)
    y, t = torch.func.jvp(ours, args, tangents)
    y_ref, t_ref = torch.func.jvp(theirs, tuple(a.double() for a in args), tuple(v.double() for v in tangents))
    assert t.dtype == dtype
    assert_close(y, y_ref, dtype)
    assert_close(t, t_ref, dtype, scale=10)


@pytest.mark.parametrize("activation", ["identity", "leaky_relu", "silu"])
def test_fused_hessian_matches_torch(activation):
    """Twice differentiable activations (and the piecewise linear ones, whose
    second derivative is 0 away from the kink): hessian = jacfwd(jacrev)."""
    g = torch.Generator().manual_seed(6)
    x = torch.randn(5, 3, 2, generator=g, dtype=torch.float64)
    r = torch.randn(x.shape, generator=g, dtype=torch.float64)
    w, b = torch.rand(3, generator=g, dtype=torch.float64) + 0.5, torch.randn(3, generator=g, dtype=torch.float64)
    ours = lambda x: (BF.batch_norm_act(x, None, None, w, b, True, residual=r, activation=activation,  # noqa: E731
                                        negative_slope=0.2) ** 2).sum()
    theirs = lambda x: (torch_activation(F.batch_norm(x, None, None, w, b, True) + r, activation) ** 2).sum()  # noqa: E731
    torch.testing.assert_close(torch.func.hessian(ours)(x), torch.func.hessian(theirs)(x))


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("fuse", [False, True], ids=["plain", "fused"])
def test_jvp_of_converted_model_matches_torch(training, fuse):
    """Training without running statistics: a transform may not mutate captured
    buffers (torch's modules raise there too)."""
    g = torch.Generator().manual_seed(7)
    reference = torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4, track_running_stats=not training), torch.nn.ReLU(),
        torch.nn.Flatten(), torch.nn.Linear(16, 5), torch.nn.BatchNorm1d(5, track_running_stats=not training),
    ).double().train(training)
    for bn in (reference[1], reference[5]):
        if not training:
            bn.running_mean.copy_(torch.randn(bn.num_features, generator=g, dtype=torch.float64))
            bn.running_var.copy_(torch.rand(bn.num_features, generator=g, dtype=torch.float64) + 0.5)
    model = torch_bn_grad.convert_batchnorm(copy.deepcopy(reference), fuse=fuse)
    x = torch.randn(6, 3, 4, 4, generator=g, dtype=torch.float64)
    tx = torch.randn(x.shape, generator=g, dtype=torch.float64)
    params = {k: v.detach() for k, v in reference.named_parameters()}
    t_params = {k: torch.randn(v.shape, generator=g, dtype=torch.float64) for k, v in params.items()}

    def call(m):
        def f(p, x):
            return torch.func.functional_call(m, p, (x,))
        return f

    y, t = torch.func.jvp(call(model), (dict(params), x), (t_params, tx))
    y_ref, t_ref = torch.func.jvp(call(reference), (dict(params), x), (t_params, tx))
    torch.testing.assert_close(y, y_ref)
    torch.testing.assert_close(t, t_ref)


def test_fused_backward_operator_refuses_tangents():
    x = torch.randn(4, 3, dtype=torch.float64)
    y, m, v = ACT_FORWARD(x, None, None, None, None, None, EPS, "relu", 0.0, "NCX", False)
    with pytest.raises(NotImplementedError, match="batch_norm_act_forward"):
        torch.func.jvp(lambda dy: torch_bn_grad.batch_norm_act_backward(dy, m, v, None, None, src=x, dst=y,
                                                                        activation="relu"),
                       (torch.ones_like(x),), (torch.ones_like(x),))


def test_split_stages_without_a_formula_raise_instead_of_dropping_tangents():
    x = torch.randn(6, 3, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="jvp"):
        torch.func.jvp(lambda x: torch_bn_grad.stages.batch_norm_local_stats(x), (x,), (torch.ones_like(x),))


@pytest.mark.parametrize("training", [True, False], ids=["train", "frozen"])
def test_gradcheck_forward_ad_and_fwd_over_rev(training):
    """torch.autograd's own checks of forward mode, with non-uniform tangents and
    upstream gradients: first order, forward over reverse, reverse over reverse."""
    g = torch.Generator().manual_seed(8)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64, requires_grad=True)  # noqa: E731
    x, w, b = r(4, 3, 5), r(3), r(3)
    rm, rv = r(3), (torch.rand(3, generator=g, dtype=torch.float64) + 0.5).requires_grad_()

    def f(x, w, b, rm, rv):
        y, m, v = FORWARD(x, w, b, None if training else rm, None if training else rv, EPS, "NCX")
        return y, m, v

    inputs = (x, w, b, rm, rv)
    assert torch.autograd.gradcheck(f, inputs, check_forward_ad=True, check_backward_ad=True)
    assert torch.autograd.gradgradcheck(f, inputs, check_fwd_over_rev=True, check_rev_over_rev=True)


@pytest.mark.parametrize("activation", ["identity", "relu", "silu"])
def test_gradcheck_forward_ad_fused(activation):
    g = torch.Generator().manual_seed(9)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64, requires_grad=True)  # noqa: E731
    x, res, w, b = r(4, 3, 5), r(4, 3, 5), r(3), r(3)

    def f(x, res, w, b):
        return ACT_FORWARD(x, w, b, None, None, res, EPS, activation, 0.0, "NCX", False)

    assert torch.autograd.gradcheck(f, (x, res, w, b), check_forward_ad=True)
    assert torch.autograd.gradgradcheck(f, (x, res, w, b), check_fwd_over_rev=True)


@pytest.mark.parametrize("training", [True, False], ids=["train", "frozen"])
def test_batch_norm_function_jvp(training):
    """BatchNormFunction (the autograd.Function of the contract) has a jvp: forward_ad
    dual tensors and gradcheck's forward-mode check."""
    g = torch.Generator().manual_seed(10)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64, requires_grad=True)  # noqa: E731
    x, w, b = r(4, 3, 5), r(3), r(3)
    rm, rv = r(3), (torch.rand(3, generator=g, dtype=torch.float64) + 0.5).requires_grad_()
    stats = (None, None) if training else (rm, rv)

    def f(x, w, b, rm, rv):
        return torch_bn_grad.BatchNormFunction.apply(x, w, b, *((None, None) if training else (rm, rv)), EPS, "NCX")

    assert torch.autograd.gradcheck(f, (x, w, b, rm, rv), check_forward_ad=True)
    tangents = [torch.randn(t.shape, generator=g, dtype=torch.float64) for t in (x, w, b)]
    with fwAD.dual_level():
        y = f(*(fwAD.make_dual(t.detach(), tt) for t, tt in zip((x, w, b), tangents)), rm.detach(), rv.detach())
        t_ours = fwAD.unpack_dual(y).tangent
    _, t_ref = torch.func.jvp(lambda x, w, b: reference_forward(x, w, b, *stats, EPS, "NCX")[0],
                              (x.detach(), w.detach(), b.detach()), tuple(tangents))
    torch.testing.assert_close(t_ours, t_ref)
