"""TorchScript: ``torch.jit.script`` and ``torch.jit.trace`` of a converted model.

Each scripted or traced model must give torch's outputs, gradients and (in
training) running-statistics updates, step after step, as the same tool gives
on the torch twin (``interop_models.twins``).
"""

from __future__ import annotations

import io
import warnings

import pytest
import torch

import torch_bn_grad
from support.interop_models import assert_same_state, example_input, twins

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::torch.jit.TracerWarning")


def _steps(reference, ours, steps: int = 3) -> None:
    """Forward and backward a few batches through both; outputs, gradients and state match."""
    for step in range(steps):
        x = example_input(step)
        x_ref, x_ours = x.clone().requires_grad_(), x.clone().requires_grad_()
        expected, actual = reference(x_ref), ours(x_ours)
        torch.testing.assert_close(actual, expected)
        grad = example_input(100 + step, tuple(expected.shape))
        expected.backward(grad)
        actual.backward(grad)
        torch.testing.assert_close(x_ours.grad, x_ref.grad)
    assert_same_state(reference, ours)
    for (name, p_ref), (_, p_ours) in zip(reference.named_parameters(), ours.named_parameters()):
        # Loose absolute tolerance: a bias feeding a training-mode BatchNorm has a gradient of
        # exactly zero in theory, rounding noise (~1e-5) in practice, for torch's modules too.
        torch.testing.assert_close(p_ours.grad, p_ref.grad, rtol=1e-4, atol=1e-4, msg=lambda m: f"{name}.grad: {m}")


@pytest.mark.parametrize("momentum", [0.1, None], ids=["momentum", "cumulative"])
@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
def test_script_matches_torch(train: bool, momentum) -> None:
    reference, ours = twins(momentum, train)
    scripted = torch.jit.script(ours)
    assert isinstance(scripted, torch.jit.ScriptModule)
    assert scripted.training == train and scripted.bn.training == train
    _steps(reference, scripted)
    # The scripted module shares the converted model's tensors, as for torch's modules.
    assert_same_state(reference, ours)


def test_script_calls_this_librarys_operator() -> None:
    _, ours = twins()
    scripted = torch.jit.script(ours)
    graph = str(scripted.bn.forward.graph) + str(scripted.bn.graph)
    inlined = scripted.bn.forward.inlined_graph if hasattr(scripted.bn.forward, "inlined_graph") else None
    text = str(inlined) if inlined is not None else graph
    assert "torch_bn_grad::batch_norm_forward" in text
    assert "aten::batch_norm" not in text


def test_script_save_load_roundtrip() -> None:
    reference, ours = twins(train=True)
    buffer = io.BytesIO()
    torch.jit.save(torch.jit.script(ours), buffer)
    buffer.seek(0)
    loaded = torch.jit.load(buffer)
    _steps(reference, loaded)
    loaded.eval()
    reference.eval()
    x = example_input(7)
    torch.testing.assert_close(loaded(x), reference(x))


def test_script_train_eval_switch() -> None:
    reference, ours = twins(train=True)
    scripted = torch.jit.script(ours)
    _steps(reference, scripted, steps=2)
    scripted.eval()
    reference.eval()
    x = example_input(9)
    torch.testing.assert_close(scripted(x), reference(x))
    assert_same_state(reference, scripted)


def test_script_batchnorm_variants() -> None:
    """affine=False, track_running_stats=False, BatchNorm1d on (N, C, L) and BatchNorm3d."""
    cases = [
        (torch.nn.BatchNorm1d(4, affine=False), (6, 4, 5)),
        (torch.nn.BatchNorm1d(4, track_running_stats=False), (6, 4)),
        (torch.nn.BatchNorm3d(3, momentum=None), (2, 3, 2, 3, 4)),
    ]
    for reference, shape in cases:
        for train in (True, False):
            reference.train(train)
            ours = torch_bn_grad.convert_batchnorm(torch.nn.Sequential(*[_copy(reference)]))
            scripted = torch.jit.script(ours)
            for step in range(2):
                x = example_input(step, shape)
                torch.testing.assert_close(scripted(x), reference(x))
            assert_same_state(torch.nn.Sequential(reference), scripted)


def test_script_rejects_bad_input_as_torch() -> None:
    _, ours = twins()
    scripted = torch.jit.script(ours)
    with pytest.raises(Exception, match="expected 4D input"):
        scripted.bn(torch.randn(2, 8, 3))
    bn = torch.jit.script(torch_bn_grad.nn.BatchNorm1d(3).train())
    with pytest.raises(Exception, match="Expected more than 1 value per channel when training"):
        bn(torch.randn(1, 3))


def _copy(module):
    import copy

    return copy.deepcopy(module)


@pytest.mark.parametrize("momentum", [0.1, None], ids=["momentum", "cumulative"])
@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
def test_trace_matches_torch(train: bool, momentum) -> None:
    reference, ours = twins(momentum, train)
    reference_traced, _ = twins(momentum, train)  # the twin traced, for the running statistics
    x = example_input(50)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        traced = torch.jit.trace(ours, x, check_trace=False)
        traced_ref = torch.jit.trace(reference_traced, x, check_trace=False)
    # Tracing ran the forward once: so did the reference.
    with torch.no_grad():
        reference(x)
    assert_same_state(reference, ours)
    assert_same_state(traced_ref, traced)
    _steps(reference, traced)
    graph = str(traced.inlined_graph)
    if train:  # training traces this library's operator
        assert "torch_bn_grad::batch_norm_forward" in graph and "aten::batch_norm" not in graph
    else:  # eval traces torch's, which TorchScript's inference passes fold (test_freeze_folds_traced_eval)
        assert "aten::batch_norm" in graph and "torch_bn_grad::" not in graph


def _batch_norm_nodes(module: torch.jit.ScriptModule) -> list[str]:
    return [n.kind() for n in module.inlined_graph.nodes() if "batch_norm" in n.kind()]


@pytest.mark.parametrize("fuse", [False, True], ids=["plain", "fused"])
def test_freeze_folds_traced_eval(fuse: bool) -> None:
    """torch.jit.freeze and optimize_for_inference fold every BatchNorm of a model traced in
    eval mode into the layer before it, as they fold torch's: same graph, same outputs."""
    reference, _ = twins()
    ours = torch_bn_grad.convert_batchnorm(_copy(reference), fuse=fuse).eval()
    x = example_input(11)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        traced = torch.jit.trace(ours, x)
        traced_ref = torch.jit.trace(reference, x)
    for optimize in (torch.jit.freeze, torch.jit.optimize_for_inference):
        folded, folded_ref = optimize(traced), optimize(traced_ref)
        assert _batch_norm_nodes(folded_ref) == []
        assert _batch_norm_nodes(folded) == []
        with torch.no_grad():
            torch.testing.assert_close(folded(x), folded_ref(x))
            torch.testing.assert_close(folded(x), reference(x))


def test_freeze_keeps_scripted_batchnorm() -> None:
    """A scripted model keeps this library's operator under torch.jit.freeze (its training
    branch updates the running statistics in place, so freeze keeps them as attributes and
    cannot fold them: a limitation in README); the frozen model still gives torch's outputs."""
    reference, ours = twins()
    frozen = torch.jit.freeze(torch.jit.script(ours))
    assert "torch_bn_grad::batch_norm_forward" in _batch_norm_nodes(frozen)
    x = example_input(12)
    with torch.no_grad():
        torch.testing.assert_close(frozen(x), reference(x))
