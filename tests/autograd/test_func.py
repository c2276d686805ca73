"""torch.func with the operators, the functional API and the modules: vmap
(through the operators' batching rules), jacrev, functional_call."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch

import torch_bn_grad
from torch_bn_grad import functional as BF

FORWARD = torch.ops.torch_bn_grad.batch_norm_forward.default
BACKWARD = torch.ops.torch_bn_grad.batch_norm_backward.default
B = 3  # vmapped batch size


@contextlib.contextmanager
def no_vmap_fallback():
    """vmap raises instead of looping over an operator without a batching rule."""
    torch._C._functorch._set_vmap_fallback_enabled(False)
    try:
        yield
    finally:
        torch._C._functorch._set_vmap_fallback_enabled(True)


def _randn(*shape, positive=False, generator):
    t = torch.randn(*shape, generator=generator, dtype=torch.float64)
    return t.abs() + 0.5 if positive else t


def _stack_per_sample(fn, in_dims, args):
    """What vmap must return: ``fn`` called on each sample, results stacked."""
    results = [fn(*(a.select(d, i) if d is not None else a for a, d in zip(args, in_dims))) for i in range(B)]
    return [torch.stack(outs) for outs in zip(*results)]


def _assert_vmap_is_per_sample(fn, in_dims, args):
    in_dims = tuple(d if a is not None else None for a, d in zip(args, in_dims))  # None arguments: no dim
    with no_vmap_fallback():
        got = torch.vmap(fn, in_dims=in_dims)(*args)
    for g, e in zip(got, _stack_per_sample(fn, in_dims, args)):
        torch.testing.assert_close(g, e)


# Per sample (shape, data_format); the last sample is large enough for the
# per-sample path of the batching rules, the others take the fused path.
SAMPLES = [((4, 3, 5), "NCX"), ((4, 5, 3), "NXC"), ((6, 3), "NCX"), ((2, 3, 2, 5), "NCX"), ((8, 3, 16, 16), "NCX")]
# in_dims of (src, per-channel tensors); None means shared by every sample.
IN_DIMS = [(0, 0), (0, None), (2, 1), (None, 0)]


def _vmap_args(shape, data_format, src_dim, param_dim, g):
    channels = shape[1] if data_format == "NCX" else shape[-1]

    def batched(sample_shape, dim, positive=False):
        if dim is None:
            return _randn(*sample_shape, positive=positive, generator=g)
        full = list(sample_shape)
        full.insert(dim, B)
        return _randn(*full, positive=positive, generator=g) * 2 + 1

    src, dy = batched(shape, src_dim), batched(shape, src_dim)
    gamma, beta = batched((channels,), param_dim, True), batched((channels,), param_dim)
    mean, var = batched((channels,), param_dim), batched((channels,), param_dim, True)
    return src, dy, gamma, beta, mean, var


@pytest.mark.parametrize("shape,data_format", SAMPLES)
@pytest.mark.parametrize("src_dim,param_dim", IN_DIMS)
def test_vmap_forward_operator(shape, data_format, src_dim, param_dim):
    g = torch.Generator().manual_seed(0)
    src, _, gamma, beta, mean, var = _vmap_args(shape, data_format, src_dim, param_dim, g)
    forward = lambda *a: FORWARD(*a, 1e-5, data_format)  # noqa: E731
    if src_dim is not None:
        _assert_vmap_is_per_sample(lambda x: forward(x, None, None, None, None), (src_dim,), (src,))
    _assert_vmap_is_per_sample(
        lambda x, w, b: forward(x, w, b, None, None), (src_dim, param_dim, param_dim), (src, gamma, beta)
    )
    _assert_vmap_is_per_sample(
        lambda x, b, m, v: forward(x, None, b, m, v), (src_dim,) + (param_dim,) * 3, (src, beta, mean, var)
    )


@pytest.mark.parametrize("shape,data_format", SAMPLES)
@pytest.mark.parametrize("src_dim,param_dim", IN_DIMS)
@pytest.mark.parametrize("training", [True, False], ids=["training", "frozen"])
def test_vmap_backward_operator(shape, data_format, src_dim, param_dim, training):
    g = torch.Generator().manual_seed(1)
    src, dy, gamma, _, mean, var = _vmap_args(shape, data_format, src_dim, param_dim, g)
    for mask in ([True, True, True], [True, False, True]):
        backward = lambda x, dy, m, v, w: BACKWARD(x, dy, m, v, w, 1e-5, data_format, training, mask)  # noqa: E731
        dims = (src_dim, src_dim, param_dim, param_dim, param_dim)
        if mask[1]:
            _assert_vmap_is_per_sample(backward, dims, (src, dy, mean, var, gamma))
        else:  # the skipped output is an unbatched placeholder
            with no_vmap_fallback():
                dx, dg, db = torch.vmap(backward, in_dims=dims, out_dims=(0, None, 0))(src, dy, mean, var, gamma)
            full = _stack_per_sample(lambda *a: BACKWARD(*a, 1e-5, data_format, training, [True] * 3), dims,
                                     (src, dy, mean, var, gamma))
            torch.testing.assert_close((dx, db), (full[0], full[2]))
            assert dg.numel() == 0


def test_vmap_broadcast_form_and_bfloat16():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(B, 4, 3, 5, generator=g)
    gamma = torch.rand(1, 3, 5, generator=g) + 0.5
    _assert_vmap_is_per_sample(lambda x, w: FORWARD(x, w, None, None, None, 1e-5, "NCX"), (0, None), (x, gamma))
    _assert_vmap_is_per_sample(lambda x: FORWARD(x, None, None, None, None, 1e-5, "NCX"), (0,), (x.bfloat16(),))


def test_vmap_rank_8_sample_and_errors():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(B, 2, 3, 2, 1, 2, 1, 2, 2, generator=g)  # rank 8 per sample: one call per sample
    _assert_vmap_is_per_sample(lambda x: FORWARD(x, None, None, None, None, 1e-5, "NCX"), (0,), (x,))
    with pytest.raises(ValueError, match="gamma must have shape"), no_vmap_fallback():
        torch.vmap(lambda x, w: FORWARD(x, w, None, None, None, 1e-5, "NCX"))(torch.randn(B, 4, 3, 5), torch.ones(B, 4))


@pytest.mark.parametrize("in_dims", [(0, 0, 0), (0, None, None), (1, 0, None)])
def test_vmap_functional_batch_norm_matches_torch(in_dims):
    g = torch.Generator().manual_seed(4)
    x = torch.randn(B, 6, 4, 5, dtype=torch.float64, generator=g).movedim(0, in_dims[0]) * 3 + 1
    w = torch.rand((B, 4) if in_dims[1] is not None else (4,), dtype=torch.float64, generator=g) + 0.5
    b = torch.randn((B, 4) if in_dims[2] is not None else (4,), dtype=torch.float64, generator=g)

    def ours(x, w, b):
        return BF.batch_norm(x, None, None, w, b, training=True)

    def theirs(x, w, b):
        return torch.nn.functional.batch_norm(x, None, None, w, b, training=True)

    with no_vmap_fallback():
        out = torch.vmap(ours, in_dims=in_dims)(x, w, b)
        # Per-sample gradients: vmap over grad goes through the backward operator's rule too.
        grads = torch.vmap(torch.func.grad(lambda x, w, b: ours(x, w, b).sin().sum(), argnums=(0, 1)), in_dims)(x, w, b)
    torch.testing.assert_close(out, torch.vmap(theirs, in_dims=in_dims)(x, w, b))
    expected = torch.vmap(torch.func.grad(lambda x, w, b: theirs(x, w, b).sin().sum(), argnums=(0, 1)), in_dims)(x, w, b)
    torch.testing.assert_close(grads, expected)


ACT_FORWARD = torch.ops.torch_bn_grad.batch_norm_act_forward.default
ACT_FORWARD_BITS = torch.ops.torch_bn_grad.batch_norm_act_forward_sign_bits.default
ACT_BACKWARD = torch.ops.torch_bn_grad.batch_norm_act_backward.default
ACTIVATIONS = [("identity", 0.0), ("relu", 0.0), ("leaky_relu", 0.2), ("silu", 0.0)]


@pytest.mark.parametrize("shape,data_format", SAMPLES[:2] + SAMPLES[3:])
@pytest.mark.parametrize("src_dim,param_dim", IN_DIMS[:3])
@pytest.mark.parametrize("activation,slope", ACTIVATIONS)
def test_vmap_fused_operators(shape, data_format, src_dim, param_dim, activation, slope):
    """The batch_norm_act operators' batching rules, with and without a residual."""
    g = torch.Generator().manual_seed(7)
    src, dy, gamma, beta, mean, var = _vmap_args(shape, data_format, src_dim, param_dim, g)
    _, residual, *_ = _vmap_args(shape, data_format, src_dim, param_dim, g)
    fwd = lambda x, w, b, m, v, r: ACT_FORWARD(x, w, b, m, v, r, 1e-5, activation, slope, data_format, False)  # noqa: E731
    dims = (src_dim,) + (param_dim,) * 4 + (src_dim,)
    _assert_vmap_is_per_sample(fwd, dims, (src, gamma, beta, None, None, residual))
    _assert_vmap_is_per_sample(fwd, dims, (src, gamma, beta, mean, var, None))
    bits = lambda x, w, r: ACT_FORWARD_BITS(x, w, None, None, None, r, 1e-5, activation, slope, data_format)  # noqa: E731
    with no_vmap_fallback():
        dst, m, v, no_bits = torch.vmap(bits, in_dims=(src_dim, param_dim, src_dim), out_dims=(0, 0, 0, None))(
            src, gamma, residual)
    expected = _stack_per_sample(lambda x, w, r: fwd(x, w, None, None, None, r)[:3], (src_dim, param_dim, src_dim),
                                 (src, gamma, residual))
    torch.testing.assert_close((dst, m, v), tuple(expected))
    assert no_bits.numel() == 0
    for training in (True, False):
        y = _stack_per_sample(lambda *a: fwd(*a)[:1], dims, (src, gamma, beta, mean, var, residual))[0]
        # One sample's output per sample, laid out as src is.
        y = y.movedim(0, src_dim) if src_dim is not None else y[0]

        def bwd(dy, x, y, r, m, v, w, b):
            return ACT_BACKWARD(dy, x, y, r, m, v, w, b, 1e-5, activation, slope, data_format, training, False,
                                [True] * 4, None)

        _assert_vmap_is_per_sample(bwd, (src_dim,) * 4 + (param_dim,) * 4, (dy, src, y, residual, mean, var, gamma, beta))


@pytest.mark.parametrize("activation,slope,memory_saving",
                         [a + (False,) for a in ACTIVATIONS] + [("identity", 0.0, True), ("leaky_relu", 0.2, True)])
def test_vmap_grad_of_fused_functional_matches_torch(activation, slope, memory_saving):
    """Per-sample gradients of batch_norm_act (vmap over grad, as in per-sample
    gradient clipping) equal those of torch's batch_norm + residual + act."""
    g = torch.Generator().manual_seed(8)
    x = torch.randn(B, 6, 4, 5, dtype=torch.float64, generator=g) * 3 + 1
    r = torch.randn(B, 6, 4, 5, dtype=torch.float64, generator=g)
    w = torch.rand(B, 4, dtype=torch.float64, generator=g) + 0.5
    b = torch.randn(4, dtype=torch.float64, generator=g)
    act = {"identity": lambda t: t, "relu": torch.relu, "silu": torch.nn.functional.silu,
           "leaky_relu": lambda t: torch.nn.functional.leaky_relu(t, slope)}[activation]

    def ours(x, w, r):
        y = BF.batch_norm_act(x, None, None, w, b, training=True, residual=r, activation=activation,
                              negative_slope=slope, memory_saving=memory_saving)
        return y.sin().sum()

    def theirs(x, w, r):
        return act(torch.nn.functional.batch_norm(x, None, None, w, b, training=True) + r).sin().sum()

    per_sample_grads = torch.vmap(torch.func.grad(ours, argnums=(0, 1, 2)), (0, 0, 0))
    if memory_saving:
        # torch.func.grad differentiates with the graph kept, which memory saving cannot give.
        with pytest.raises(NotImplementedError, match="memory_saving=True does not keep"), no_vmap_fallback():
            per_sample_grads(x, w, r)
        return
    with no_vmap_fallback():
        got = per_sample_grads(x, w, r)
    expected = torch.vmap(torch.func.grad(theirs, argnums=(0, 1, 2)), (0, 0, 0))(x, w, r)
    torch.testing.assert_close(got, expected)


def _mlp_params(g: torch.Generator) -> dict:
    return {
        "w1": torch.randn(5, 3, dtype=torch.float64, generator=g),
        "gamma": torch.rand(5, dtype=torch.float64, generator=g) + 0.5,
        "beta": torch.randn(5, dtype=torch.float64, generator=g),
        "w2": torch.randn(2, 5, dtype=torch.float64, generator=g),
    }


def _mlp(batch_norm):
    """Linear-BN(batch statistics)-tanh-Linear, with the given batch_norm."""
    def f(params: dict, x: torch.Tensor) -> torch.Tensor:
        h = batch_norm(x @ params["w1"].T, None, None, params["gamma"], params["beta"], training=True)
        return torch.tanh(h) @ params["w2"].T
    return f


def test_jacrev_of_small_model_matches_torch():
    g = torch.Generator().manual_seed(5)
    params, x = _mlp_params(g), torch.randn(6, 3, dtype=torch.float64, generator=g)
    ours, theirs = _mlp(BF.batch_norm), _mlp(torch.nn.functional.batch_norm)
    with no_vmap_fallback():
        jac = torch.func.jacrev(ours, argnums=(0, 1))(params, x)
        # Second order: jacrev of jacrev runs the backward operator's own derivative.
        hess = torch.func.jacrev(torch.func.jacrev(lambda x: ours(params, x).sum()))(x)
    torch.testing.assert_close(jac, torch.func.jacrev(theirs, argnums=(0, 1))(params, x))
    torch.testing.assert_close(hess, torch.func.jacrev(torch.func.jacrev(lambda x: theirs(params, x).sum()))(x))


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_functional_call_of_modules_matches_torch(training):
    g = torch.Generator().manual_seed(6)
    reference = torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU(), torch.nn.Flatten(),
        torch.nn.Linear(16, 5), torch.nn.BatchNorm1d(5, momentum=None),
    ).double().train(training)
    model = torch_bn_grad.convert_batchnorm(copy.deepcopy(reference))
    state = {name: torch.randn(t.shape, dtype=t.dtype, generator=g).abs() + 0.5 if t.is_floating_point() else t + 2
             for name, t in reference.state_dict().items()}
    x = torch.randn(5, 3, 4, 4, dtype=torch.float64, generator=g)

    def loss(module, state):
        return torch.func.functional_call(module, state, (x,)).sin().sum()

    ours_state = {k: v.clone().requires_grad_(v.is_floating_point() and "running" not in k) for k, v in state.items()}
    ref_state = {k: v.clone().requires_grad_(v.is_floating_point() and "running" not in k) for k, v in state.items()}
    ours_loss, ref_loss = loss(model, ours_state), loss(reference, ref_state)
    torch.testing.assert_close(ours_loss, ref_loss)
    params = [k for k, v in state.items() if v.is_floating_point() and "running" not in k]
    grads = torch.autograd.grad(ours_loss, [ours_state[k] for k in params])
    ref_grads = torch.autograd.grad(ref_loss, [ref_state[k] for k in params])
    torch.testing.assert_close(grads, ref_grads)
    # The buffers passed in are the ones updated in place (train), or left alone (eval).
    for name in state:
        torch.testing.assert_close(ours_state[name].detach(), ref_state[name].detach(), msg=lambda m: f"{name}: {m}")
    assert torch.equal(ours_state["1.num_batches_tracked"], state["1.num_batches_tracked"] + training)
    # The modules' own tensors were not touched.
    for name, t in model.state_dict().items():
        torch.testing.assert_close(t, reference.state_dict()[name])
