"""PyTorch's own test samples for batch norm, run against ours.

Every sample of the OpInfo entries named ``nn.functional.batch_norm``
(``torch.testing._internal.common_methods_invocations.op_db``) goes through
``torch_bn_grad.functional.batch_norm`` and torch's, and every ModuleInfo
sample of ``nn.BatchNorm1d/2d/3d`` (``common_modules.module_db``, error
inputs included) through our module and torch's, in train and eval mode:
the same outputs, errors, running statistics and gradients.

torch's test helpers need ``expecttest`` (in requirements-test.txt); where
they do not import, these tests are skipped, and the reason printed.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch

import torch_bn_grad
from torch_bn_grad import nn as bn_nn

try:
    from torch.testing._internal.common_methods_invocations import op_db
    from torch.testing._internal.common_modules import module_db
except Exception as exc:  # noqa: BLE001 (torch's test helpers have optional dependencies)
    op_db, module_db = [], []
    SKIP = f"torch's OpInfo/ModuleInfo database does not import here ({type(exc).__name__}: {exc})"
else:
    SKIP = ""

pytestmark = pytest.mark.skipif(bool(SKIP), reason=SKIP)

OPS = [op for op in op_db if op.name == "nn.functional.batch_norm"]
MODULES = [m for m in module_db if m.module_cls in (torch.nn.BatchNorm1d, torch.nn.BatchNorm2d, torch.nn.BatchNorm3d)]
OURS = {torch.nn.BatchNorm1d: bn_nn.BatchNorm1d, torch.nn.BatchNorm2d: bn_nn.BatchNorm2d,
        torch.nn.BatchNorm3d: bn_nn.BatchNorm3d}
DTYPES = [torch.float64, torch.float32]


def _clone(value):
    if isinstance(value, torch.Tensor):
        leaf = value.detach().clone()
        return leaf.requires_grad_(value.requires_grad)
    return value


def _run(fn):
    """(result, None) or (None, exception)."""
    try:
        return fn(), None
    except Exception as exc:  # noqa: BLE001 (compared with torch's below)
        return None, exc


def _assert_same_outcome(ours, theirs, what: str) -> None:
    (out, err), (ref, ref_err) = ours, theirs
    if ref_err is not None:
        assert err is not None, f"{what}: torch raises {type(ref_err).__name__}({ref_err}), ours returned"
        return
    assert err is None, f"{what}: torch returns, ours raised {type(err).__name__}: {err}"
    torch.testing.assert_close(out, ref, msg=lambda m: f"{what}: output: {m}")


def test_the_samples_exist():
    assert OPS, "no OpInfo named nn.functional.batch_norm"
    assert len(MODULES) == 3, [m.name for m in MODULES]


def _op_id(op) -> str:
    return op.variant_test_name or "default"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", OPS, ids=_op_id)
def test_functional_samples(op, dtype):
    samples = list(op.sample_inputs("cpu", dtype, requires_grad=True))
    assert any(s.input.dim() == 1 and s.input.numel() == 0 for s in samples), "the rank-1 empty sample is gone"
    for index, sample in enumerate(samples):
        what = f"sample {index}: input {tuple(sample.input.shape)}, kwargs {sample.kwargs}"
        theirs_args = [_clone(a) for a in (sample.input, *sample.args)]
        ours_args = [_clone(a) for a in (sample.input, *sample.args)]
        theirs = _run(lambda: torch.nn.functional.batch_norm(*theirs_args, **sample.kwargs))
        ours = _run(lambda: torch_bn_grad.functional.batch_norm(*ours_args, **sample.kwargs))
        _assert_same_outcome(ours, theirs, what)
        if theirs[1] is not None:
            continue
        # Running statistics updated in place (or not) alike.
        for mine, ref in zip(ours_args[1:3], theirs_args[1:3]):
            if ref is not None:
                torch.testing.assert_close(mine, ref, msg=lambda m: f"{what}: running statistics: {m}")
        # Gradients of input, weight and bias.
        wrt = [i for i, a in enumerate(theirs_args) if isinstance(a, torch.Tensor) and a.requires_grad]
        if not wrt or theirs[0].numel() == 0:
            continue
        grad = torch.randn_like(theirs[0])
        ref_grads = torch.autograd.grad(theirs[0], [theirs_args[i] for i in wrt], grad, allow_unused=True)
        my_grads = torch.autograd.grad(ours[0], [ours_args[i] for i in wrt], grad, allow_unused=True)
        for i, mine, ref in zip(wrt, my_grads, ref_grads):
            if ref is None:
                assert mine is None or not mine.any(), f"{what}: argument {i}: torch has no gradient"
            else:
                torch.testing.assert_close(mine, ref, msg=lambda m, i=i: f"{what}: gradient of argument {i}: {m}")


def test_rank1_empty_input_in_training_returns_empty():
    x = torch.empty(0)
    for training in (True, False):
        mean, var = torch.zeros(0), torch.ones(0)
        out = torch_bn_grad.functional.batch_norm(x, mean, var, training=training)
        ref = torch.nn.functional.batch_norm(x, torch.zeros(0), torch.ones(0), training=training)
        assert out.shape == ref.shape == (0,) and out.dtype == ref.dtype


def _make_modules(module_info, module_input, training: bool):
    args, kwargs = module_input.constructor_input.args, module_input.constructor_input.kwargs
    theirs = module_info.module_cls(*args, **kwargs).to(torch.float64)
    ours = OURS[module_info.module_cls](*args, **kwargs).to(torch.float64)
    ours.load_state_dict(theirs.state_dict())
    with torch.no_grad():
        for p in theirs.parameters():
            p.uniform_(0.5, 1.5)
        for pm, pt in zip(ours.parameters(), theirs.parameters()):
            pm.copy_(pt)
    return theirs.train(training), ours.train(training)


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("module_info", MODULES, ids=lambda m: m.name)
def test_module_samples(module_info, dtype, training):
    inputs = module_info.module_inputs_func(module_info, device="cpu", dtype=dtype, requires_grad=True,
                                            training=training)
    for module_input in inputs:
        what = f"{module_info.name} {module_input.desc or 'default'}"
        theirs, ours = _make_modules(module_info, module_input, training)
        theirs.to(dtype), ours.to(dtype)
        x_theirs = _clone(module_input.forward_input.args[0])
        x_ours = _clone(module_input.forward_input.args[0])
        for step in range(2):  # the second step sees updated running statistics
            ref, err = _run(lambda: theirs(x_theirs))
            out = _run(lambda: ours(x_ours))
            _assert_same_outcome(out, (ref, err), f"{what} step {step}")
            for (name, b_ref), (_, b_ours) in zip(theirs.named_buffers(), ours.named_buffers()):
                torch.testing.assert_close(b_ours, b_ref, msg=lambda m, name=name: f"{what}: {name}: {m}")
            if ref.numel():
                grad = torch.randn_like(ref)
                wrt_t = [x_theirs, *theirs.parameters()]
                wrt_o = [x_ours, *ours.parameters()]
                for g_o, g_t in zip(torch.autograd.grad(out[0], wrt_o, grad), torch.autograd.grad(ref, wrt_t, grad)):
                    torch.testing.assert_close(g_o, g_t, msg=lambda m: f"{what}: gradient: {m}")


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("module_info", MODULES, ids=lambda m: m.name)
def test_module_error_samples(module_info, training):
    errors = module_info.module_error_inputs_func(module_info, device="cpu", dtype=torch.float64,
                                                  requires_grad=False, training=training)
    assert errors
    for error_input in errors:
        module_input = error_input.module_error_input
        args, kwargs = module_input.constructor_input.args, module_input.constructor_input.kwargs
        x = module_input.forward_input.args[0]
        theirs = _run(lambda: module_info.module_cls(*args, **kwargs).to(torch.float64).train(training)(x))
        ours = _run(lambda: OURS[module_info.module_cls](*args, **kwargs).to(torch.float64).train(training)(x))
        _assert_same_outcome(ours, theirs, f"{module_info.name} {kwargs}")
        if theirs[1] is not None and re.search(error_input.error_regex, str(theirs[1])):
            # Where torch's error is the sample's (training; eval has a message of its own), so is ours.
            assert isinstance(ours[1], error_input.error_type), ours[1]
            assert re.search(error_input.error_regex, str(ours[1])), ours[1]
        elif theirs[1] is not None:  # caught by what catches torch's (ours may be a subclass, see errors.py)
            assert isinstance(ours[1], type(theirs[1])), (ours[1], theirs[1])


def test_converted_module_matches_on_module_samples():
    """convert_batchnorm of torch's module runs the same samples alike."""
    info = next(m for m in MODULES if m.module_cls is torch.nn.BatchNorm2d)
    for module_input in info.module_inputs_func(info, device="cpu", dtype=torch.float64, requires_grad=False,
                                                training=True):
        args, kwargs = module_input.constructor_input.args, module_input.constructor_input.kwargs
        theirs = torch.nn.BatchNorm2d(*args, **kwargs).double()
        ours = torch_bn_grad.convert_batchnorm(copy.deepcopy(theirs))
        x = module_input.forward_input.args[0]
        torch.testing.assert_close(ours(x), theirs(x))
