"""The drop-in API raises what torch's batch norm raises, down to the class:
``RuntimeError`` for a ``running_mean``, ``running_var``, ``weight`` or ``bias``
of the wrong size or dtype, while staying the documented ``ValueError`` /
``TypeError`` with the operators' messages (``torch_bn_grad.errors``). And a
program that rebinds ``torch.nn.SyncBatchNorm`` to this library's gets a
working module."""

from __future__ import annotations

import warnings

import pytest
import torch

import torch_bn_grad
from torch_bn_grad import errors, functional
from torch_bn_grad import nn as bnn

ARGUMENTS = ["running_mean", "running_var", "weight", "bias"]
OPERATOR_NAMES = {"running_mean": "mean", "running_var": "variance", "weight": "gamma", "bias": "beta"}


def _arguments(bad: str, value: torch.Tensor) -> dict:
    args = {"running_mean": torch.zeros(4), "running_var": torch.ones(4), "weight": torch.ones(4),
            "bias": torch.zeros(4)}
    args[bad] = value
    return args


def _raised(call) -> BaseException:
    with pytest.raises(Exception) as info:
        call()
    return info.value


@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("name", ARGUMENTS)
def test_functional_wrong_size_is_a_runtime_and_a_value_error(name, training):
    x = torch.randn(2, 4, 3)
    args = _arguments(name, torch.ones(3))
    snapshot = {k: v.clone() for k, v in args.items()}
    torch_error = _raised(lambda: torch.nn.functional.batch_norm(x, training=training, **args))
    assert type(torch_error) is RuntimeError  # what code written for torch catches
    for fn in (functional.batch_norm, functional.batch_norm_act):
        error = _raised(lambda: fn(x, training=training, **args))
        assert isinstance(error, RuntimeError) and isinstance(error, ValueError), type(error)
        assert type(error) is errors.BatchNormValueError
        assert error.__cause__ is None and error.__suppress_context__
        # The operator's own message, unchanged: it names the argument, expected and actual.
        assert name in str(error) or f"{OPERATOR_NAMES[name]} must have shape [4]" in str(error), str(error)
        assert "3" in str(error)
    for k, v in args.items():  # inputs untouched
        assert torch.equal(v, snapshot[k]), k


@pytest.mark.parametrize("name", ARGUMENTS)
def test_message_is_the_operators(name):
    """The re-raised error carries exactly the message the operator raises."""
    x = torch.randn(2, 4, 3)
    args = _arguments(name, torch.ones(3))
    with pytest.raises(ValueError) as direct:
        torch_bn_grad.batch_norm_forward(x, args["weight"], args["bias"], args["running_mean"],
                                         args["running_var"])
    with pytest.raises(RuntimeError) as dropin:
        functional.batch_norm(x, **args)
    assert str(dropin.value) == str(direct.value)
    assert type(direct.value) is ValueError  # the operators keep the plain class


@pytest.mark.parametrize("name", ARGUMENTS)
def test_wrong_dtype_is_a_runtime_and_a_type_error(name):
    x = torch.randn(2, 4, 3)
    args = _arguments(name, torch.ones(4, dtype=torch.int32))
    error = _raised(lambda: functional.batch_norm(x, **args))
    assert type(error) is errors.BatchNormTypeError
    assert isinstance(error, RuntimeError) and isinstance(error, TypeError)


def _module(kind: str, name: str, size: int = 3) -> torch.nn.Module:
    module = {"BatchNorm1d": bnn.BatchNorm1d, "BatchNormAct1d": bnn.BatchNormAct1d,
              "SyncBatchNorm": bnn.SyncBatchNorm, "SyncBatchNormAct": bnn.SyncBatchNormAct}[kind](4)
    if name in ("weight", "bias"):
        setattr(module, name, torch.nn.Parameter(torch.ones(size)))
    else:
        setattr(module, name, torch.ones(size))
    return module


@pytest.mark.parametrize("masked", [False, True], ids=["plain", "masked"])
@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("kind", ["BatchNorm1d", "BatchNormAct1d", "SyncBatchNorm", "SyncBatchNormAct"])
@pytest.mark.parametrize("name", ARGUMENTS)
def test_module_errors_are_caught_as_torch_raises_them(name, kind, training, masked):
    x = torch.randn(2, 4, 3)
    mask = torch.tensor([[True, True, False], [True, False, False]]) if masked else None
    module = _module(kind, name).train(training)
    before = {k: v.clone() for k, v in module.state_dict().items()}
    try:
        module(x) if mask is None else module(x, mask=mask)
    except RuntimeError as error:  # torch's modules raise RuntimeError
        assert isinstance(error, ValueError), type(error)
    else:
        pytest.fail("no error")
    after = module.state_dict()
    for k, v in before.items():  # no statistics written (num_batches_tracked counts the call, as torch's does)
        if k != "num_batches_tracked":
            assert torch.equal(after[k], v), k


def test_mask_errors_are_runtime_errors_too():
    module = bnn.BatchNorm1d(4).train()
    x = torch.randn(2, 4, 3)
    error = _raised(lambda: module(x, mask=torch.ones(2, 3)))
    assert type(error) is errors.BatchNormTypeError
    error = _raised(lambda: module(x, mask=torch.ones(2, 4, dtype=torch.bool)))
    assert type(error) is errors.BatchNormValueError
    assert int(module.num_batches_tracked) == 0


def test_good_calls_raise_nothing_and_compile_without_graph_breaks():
    """The except clauses change nothing on the way through, nor under torch.compile."""
    from torch._dynamo.utils import counters

    module = bnn.BatchNormAct1d(4).eval()
    x = torch.randn(2, 4, 3)
    counters.clear()
    compiled = torch.compile(module, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(x), module(x))
    assert not counters["graph_break"]


def test_rebinding_torch_sync_batch_norm():
    """``torch.nn.SyncBatchNorm = torch_bn_grad.nn.SyncBatchNorm`` (to reach third-party
    code) gives working modules and conversions, not a RecursionError."""
    original = torch.nn.SyncBatchNorm
    genuine = original(4)  # made before the rebinding
    torch.nn.SyncBatchNorm = bnn.SyncBatchNorm
    try:
        module = torch.nn.SyncBatchNorm(4)  # what third-party code now builds
        assert type(module) is bnn.SyncBatchNorm
        x = torch.randn(2, 4, 3)
        reference = original(4)
        torch.testing.assert_close(module(x), reference(x))
        with pytest.raises(ValueError, match="expected at least 2D input"):  # torch's own check, still reached
            module(torch.randn(4))
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # nothing left unconverted
            converted = torch_bn_grad.convert_batchnorm(torch.nn.Sequential(genuine, torch.nn.BatchNorm1d(4)),
                                                        sync=False)
        assert [type(m) for m in converted] == [bnn.SyncBatchNorm, bnn.BatchNorm1d]
        assert converted[0].weight is genuine.weight
    finally:
        torch.nn.SyncBatchNorm = original
    assert torch.nn.SyncBatchNorm is original
