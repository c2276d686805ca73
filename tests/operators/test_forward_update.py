"""The ``.update`` overloads (``batch_norm_forward``, ``batch_norm_act_forward``,
``batch_norm_act_forward_sign_bits``): the training forward and the
running-statistics update in one call (an eager step's forward). Their results
are bit for bit those of the forward followed by
``batch_norm_update_running_stats`` with the elements per channel as count, on
every device; autograd, the buffers' versions, fakes and the eager routing of
``functional.batch_norm`` and ``functional.batch_norm_act``.
"""

from __future__ import annotations

import pytest
import torch

import torch_bn_grad
from support.recorded_ops import RecordedOps
from support.reference import normalization_inputs

FORWARD = torch.ops.torch_bn_grad.batch_norm_forward.default
FORWARD_UPDATE = torch.ops.torch_bn_grad.batch_norm_forward.update
UPDATE = torch.ops.torch_bn_grad.batch_norm_update_running_stats.default
ACT = torch.ops.torch_bn_grad.batch_norm_act_forward
ACT_SIGN_BITS = torch.ops.torch_bn_grad.batch_norm_act_forward_sign_bits
EPS = 1e-5

# (data dtype, running buffers' dtype): a model's float32 buffers, and those of
# a model cast to half precision (float32 statistics into half buffers).
DTYPES = [(torch.float32, torch.float32), (torch.float64, torch.float64), (torch.bfloat16, torch.float32),
          (torch.float16, torch.float16), (torch.bfloat16, torch.bfloat16)]


def _buffers(channels: int, dtype: torch.dtype, device: str):
    g = torch.Generator().manual_seed(channels)
    return (torch.randn(channels, generator=g).to(device, dtype),
            (torch.rand(channels, generator=g) + 0.5).to(device, dtype))


def _assert_bitwise(actual, expected) -> None:
    for a, b in zip(actual, expected):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a, b) or torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
@pytest.mark.parametrize("dtypes", DTYPES, ids=[f"{d}-{b}".replace("torch.", "") for d, b in DTYPES])
def test_equals_the_forward_then_the_update(device, dtypes, layout):
    dtype, buffer_dtype = dtypes
    x, gamma, beta = normalization_inputs((6, 7, 5, 3), dtype, layout, seed=3, scale=2, offset=4)
    x, gamma, beta = x.to(device), gamma.to(device), beta.to(device)
    rm, rv = _buffers(7, buffer_dtype, device)
    expected_rm, expected_rv = rm.clone(), rv.clone()
    expected = FORWARD(x, gamma, beta, None, None, EPS, "NCX")
    UPDATE(expected_rm, expected_rv, expected[1], expected[2], 6 * 5 * 3, 0.3)
    got = FORWARD_UPDATE(x, gamma, beta, rm, rv, 0.3, EPS, "NCX")
    _assert_bitwise(got, expected)
    _assert_bitwise((rm, rv), (expected_rm, expected_rv))
    assert got[0].stride() == expected[0].stride()


def test_absent_buffers_and_an_empty_batch(device):
    x = torch.randn(4, 3, 2, device=device)
    rm, rv = _buffers(3, torch.float32, device)
    start_rm, start_rv = rm.clone(), rv.clone()
    FORWARD_UPDATE(x, None, None, None, rv, 0.5, EPS, "NCX")  # running_var only
    assert torch.equal(rm, start_rm) and not torch.equal(rv, start_rv)
    FORWARD_UPDATE(x, None, None, rm, None, 0.5, EPS, "NCX")
    assert not torch.equal(rm, start_rm)

    rm, rv = _buffers(3, torch.float32, device)
    dst, mean, var = FORWARD_UPDATE(torch.empty(0, 3, 2, device=device), None, None, rm, rv, 0.5, EPS, "NCX")
    assert dst.shape == (0, 3, 2) and mean.isnan().all() and var.isnan().all()
    start_rm, start_rv = _buffers(3, torch.float32, device)  # an empty batch updates nothing
    assert torch.equal(rm, start_rm) and torch.equal(rv, start_rv)


def test_autograd_is_the_forwards_and_versions_are_bumped(device):
    x, gamma, beta = normalization_inputs((5, 4, 3, 3), torch.float64, "contiguous", seed=5, offset=1)
    x, gamma, beta = (t.to(device).requires_grad_() for t in (x, gamma, beta))
    rm, rv = _buffers(4, torch.float64, device)
    versions = (rm._version, rv._version)
    dy = torch.randn(5, 4, 3, 3, dtype=torch.float64, device=device)
    dst, mean, var = FORWARD_UPDATE(x, gamma, beta, rm, rv, 0.1, EPS, "NCX")
    assert rm._version > versions[0] and rv._version > versions[1]
    loss = (dst * dy).sum() + mean.sum() + (var * 2).sum()  # the statistics are differentiable outputs too
    got = torch.autograd.grad(loss, (x, gamma, beta))
    ref_dst, ref_mean, ref_var = FORWARD(x, gamma, beta, None, None, EPS, "NCX")
    expected = torch.autograd.grad((ref_dst * dy).sum() + ref_mean.sum() + (ref_var * 2).sum(), (x, gamma, beta))
    _assert_bitwise(got, expected)
    torch.autograd.gradcheck(lambda *a: FORWARD_UPDATE(*a, None, None, 0.1, EPS, "NCX"), (x, gamma, beta))


def test_errors_name_the_argument_before_anything_changes():
    x = torch.randn(4, 3, 2)
    rm, rv = torch.zeros(3), torch.ones(5)
    with pytest.raises(ValueError, match="running_var must have one value per channel"):
        FORWARD_UPDATE(x, None, None, rm, rv, 0.1, EPS, "NCX")
    assert torch.equal(rm, torch.zeros(3))
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="running_mean must be on src's device"):
            FORWARD_UPDATE(x, None, None, torch.zeros(3, device="cuda"), None, 0.1, EPS, "NCX")


def test_opcheck(device):
    x, gamma, beta = normalization_inputs((4, 3, 2, 2), torch.float32, "contiguous", seed=1)
    rm, rv = _buffers(3, torch.float32, device)
    torch.library.opcheck(FORWARD_UPDATE, (x.to(device), gamma.to(device), beta.to(device), rm, rv, 0.1, EPS, "NCX"))


# (our module, the operator it calls, the torch module and activation it replaces)
MODULES = [("BatchNorm", "batch_norm_forward", lambda t: t), ("BatchNormAct", "batch_norm_act_forward", torch.relu)]


@pytest.mark.parametrize("module", MODULES, ids=[m[0] for m in MODULES])
def test_eager_training_steps_take_one_call(device, module):
    name, op, _ = module
    layer = getattr(torch_bn_grad.nn, f"{name}2d")(3).to(device)
    x = torch.randn(4, 3, 2, 2, device=device)
    with RecordedOps() as ops:
        layer(x)
    assert f"torch_bn_grad.{op}.update" in ops.names
    assert not any("update_running_stats" in name for name in ops.names)
    # The cumulative average's momentum is a tensor: the forward, then the tensor arithmetic.
    layer = getattr(torch_bn_grad.nn, f"{name}2d")(3, momentum=None).to(device)
    with RecordedOps() as ops:
        layer(x)
    assert f"torch_bn_grad.{op}.default" in ops.names
    assert not any(".update" in name for name in ops.names)


@pytest.mark.parametrize("module", MODULES, ids=[m[0] for m in MODULES])
def test_module_running_statistics_equal_torchs(device, module):
    name, _, activation = module
    torch.manual_seed(0)
    ours, native = getattr(torch_bn_grad.nn, f"{name}1d")(6).to(device), torch.nn.BatchNorm1d(6).to(device)
    for _ in range(4):
        x = torch.randn(8, 6, 5, device=device) * 2 + 3
        torch.testing.assert_close(ours(x), activation(native(x)))
    torch.testing.assert_close(ours.running_mean, native.running_mean)
    torch.testing.assert_close(ours.running_var, native.running_var)
    assert ours.num_batches_tracked == native.num_batches_tracked

# The fused forward: (activation, negative_slope, with a residual, memory_saving).
ACT_CASES = [("relu", 0.0, True, False), ("leaky_relu", 0.1, False, True), ("silu", 0.0, True, False),
             ("identity", 0.0, False, False)]


def _act_inputs(shape, dtype, layout, residual, device):
    x, gamma, beta = normalization_inputs(shape, dtype, layout, seed=7, scale=2, offset=3)
    r = torch.randn(shape, generator=torch.Generator().manual_seed(8)).to(dtype) if residual else None
    if r is not None and layout == "channels_last":
        r = r.contiguous(memory_format=torch.channels_last)
    return tuple(t.to(device) if t is not None else None for t in (x, gamma, beta, r))


@pytest.mark.parametrize("case", ACT_CASES, ids=[c[0] for c in ACT_CASES])
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
@pytest.mark.parametrize("dtypes", DTYPES, ids=[f"{d}-{b}".replace("torch.", "") for d, b in DTYPES])
def test_fused_forwards_equal_the_forward_then_the_update(device, dtypes, layout, case):
    dtype, buffer_dtype = dtypes
    activation, slope, residual, memory_saving = case
    x, gamma, beta, r = _act_inputs((6, 8, 5, 4), dtype, layout, residual, device)
    args = (r, EPS, activation, slope, "NCX")
    for op, extra in ((ACT, (memory_saving,)), (ACT_SIGN_BITS, ())):
        rm, rv = _buffers(8, buffer_dtype, device)
        expected_rm, expected_rv = rm.clone(), rv.clone()
        expected = op.default(x, gamma, beta, None, None, *args, *extra)
        UPDATE(expected_rm, expected_rv, expected[1], expected[2], 6 * 5 * 4, 0.3)
        got = op.update(x, gamma, beta, rm, rv, r, 0.3, *args[1:], *extra)
        _assert_bitwise(got, expected)  # the sign bits too
        _assert_bitwise((rm, rv), (expected_rm, expected_rv))
        assert got[0].stride() == expected[0].stride()


@pytest.mark.parametrize("case", ACT_CASES, ids=[c[0] for c in ACT_CASES])
def test_fused_autograd_is_the_forwards_and_versions_are_bumped(device, case):
    activation, slope, residual, memory_saving = case
    x, gamma, beta, r = _act_inputs((5, 4, 3, 3), torch.float64, "contiguous", residual, device)
    inputs = [t.requires_grad_() for t in (x, gamma, beta, r) if t is not None]
    dy = torch.randn(5, 4, 3, 3, dtype=torch.float64, device=device)
    rm, rv = _buffers(4, torch.float64, device)
    versions = (rm._version, rv._version)
    dst, mean, var = ACT.update(x, gamma, beta, rm, rv, r, 0.1, EPS, activation, slope, "NCX", memory_saving)
    assert rm._version > versions[0] and rv._version > versions[1]
    got = torch.autograd.grad((dst * dy).sum(), inputs)
    ref_dst, _, _ = ACT.default(x, gamma, beta, None, None, r, EPS, activation, slope, "NCX", memory_saving)
    _assert_bitwise(got, torch.autograd.grad((ref_dst * dy).sum(), inputs))
    dst, mean, var, bits = ACT_SIGN_BITS.update(x, gamma, beta, rm, rv, r, 0.1, EPS, activation, slope, "NCX")
    assert not bits.requires_grad
    if not memory_saving:  # memory saving has no double backward; the statistics' gradients take the composite
        torch.autograd.gradcheck(
            lambda *a: ACT.update(*a[:3], None, None, a[3] if residual else None, 0.1, EPS, activation, slope,
                                  "NCX", False), tuple(inputs), check_batched_grad=False)


def test_fused_autograd_saves_the_sign_bits_where_the_forward_would():
    """Eager CPU relu: the update's autograd saves dst's sign bits (the update's
    sign-bits operator below autograd), as the plain forward's does."""
    x, gamma, beta, _ = _act_inputs((4, 8, 4, 4), torch.float32, "contiguous", False, "cpu")
    x.requires_grad_()
    rm, rv = _buffers(8, torch.float32, "cpu")
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        ACT.update(x, gamma, beta, rm, rv, None, 0.1, EPS, "relu", 0.0, "NCX", False)
    assert [t.numel() for t in saved if t.dtype == torch.uint8] == [4 * 8 * 4 * 4 // 8]


def test_fused_errors_name_the_argument_before_anything_changes():
    x = torch.randn(4, 3, 2)
    rm, rv = torch.zeros(3), torch.ones(5)
    for call in (lambda: ACT.update(x, None, None, rm, rv, None, 0.1, EPS, "relu", 0.0, "NCX", False),
                 lambda: ACT_SIGN_BITS.update(x, None, None, rm, rv, None, 0.1, EPS, "relu", 0.0, "NCX")):
        with pytest.raises(ValueError, match="running_var must have one value per channel"):
            call()
        assert torch.equal(rm, torch.zeros(3))
    with pytest.raises(ValueError, match="residual"):
        ACT.update(x, None, None, torch.zeros(3), None, torch.ones(4, 3), 0.1, EPS, "relu", 0.0, "NCX", False)
    assert torch.equal(rm, torch.zeros(3))


def test_fused_opcheck(device):
    x, gamma, beta, r = _act_inputs((4, 8, 2, 2), torch.float32, "contiguous", True, device)
    rm, rv = _buffers(8, torch.float32, device)
    torch.library.opcheck(ACT.update, (x, gamma, beta, rm, rv, r, 0.1, EPS, "relu", 0.0, "NCX", False))
    torch.library.opcheck(ACT_SIGN_BITS.update, (x, gamma, beta, rm, rv, r, 0.1, EPS, "leaky_relu", 0.1, "NCX"))
