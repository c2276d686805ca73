"""torch.compile, torch.export and AOTInductor with this library's BatchNorm.

The models are tiny and the steps few: every compile costs seconds on CPU.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from typing import Optional

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters

import torch_bn_grad
from support.compile_steps import fresh_dynamo, sgd_step  # noqa: F401  (fresh_dynamo: an autouse fixture)

SPATIAL = (3, 6, 6)


def _model(momentum: Optional[float] = 0.1) -> torch.nn.Module:
    """Conv-BN2d-ReLU-Linear-BN1d with non-trivial affine parameters and running statistics."""
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.BatchNorm2d(4, momentum=momentum), torch.nn.ReLU(),
        torch.nn.Flatten(), torch.nn.Linear(4 * 36, 5), torch.nn.BatchNorm1d(5, momentum=momentum),
    )
    with torch.no_grad():
        for bn in (model[1], model[5]):
            bn.weight.uniform_(0.5, 1.5, generator=g)
            bn.bias.normal_(generator=g)
            bn.running_mean.normal_(generator=g)
            bn.running_var.uniform_(0.5, 2.0, generator=g)
    return torch_bn_grad.convert_batchnorm(model)


def _inputs(batch: int, seed: int, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x, target = torch.randn(batch, *SPATIAL, generator=g) * 2 + 0.5, torch.randint(0, 5, (batch,), generator=g)
    return x.to(device), target.to(device)


def _assert_same_state(model: torch.nn.Module, reference: torch.nn.Module) -> None:
    for (name, t), (_, ref) in zip(model.state_dict().items(), reference.state_dict().items()):
        torch.testing.assert_close(t, ref, msg=lambda m: f"{name}: {m}")


def _assert_steps_match(compiled, model, reference, batches, device: str = "cpu") -> None:
    for seed, batch in enumerate(batches):
        x, target = _inputs(batch, seed, device)
        out, grads = sgd_step(compiled, model, x, target)
        ref_out, ref_grads = sgd_step(reference, reference, x, target)
        torch.testing.assert_close(out, ref_out)
        for grad, ref_grad in zip(grads, ref_grads):
            torch.testing.assert_close(grad, ref_grad)
    _assert_same_state(model, reference)


# (shape per step, data_format, gamma's shape as a function of the shape)
OPERATOR_FORMS = {
    "NCX": ([(4, 3, 5), (6, 7, 9), (5, 2, 11)], "NCX", lambda s: (s[1],)),
    "NXC": ([(4, 5, 3), (6, 9, 7), (5, 11, 2)], "NXC", lambda s: (s[-1],)),
    "broadcast": ([(4, 3, 5), (6, 7, 9), (5, 2, 11)], "NCX", lambda s: (1, s[1], s[2])),
}


@pytest.mark.parametrize("form", OPERATOR_FORMS)
def test_operators_trace_with_symbolic_sizes(form):
    """The fakes and the autograd formulas specialize on no size: every size
    changes between calls, with first and second derivatives, and nothing recompiles."""
    shapes, data_format, gamma_shape = OPERATOR_FORMS[form]

    def fn(x, dy, gamma):
        dst, mean, var = torch_bn_grad.batch_norm_forward(x, gamma, None, data_format=data_format)
        dx, dgamma, dbeta = torch_bn_grad.batch_norm_backward(x, dy, mean, var, gamma, data_format=data_format)
        return dst.sin().sum() + dx.square().sum() + dgamma.sum() + dbeta.sum()

    compiled = torch.compile(fn, backend="aot_eager", dynamic=True, fullgraph=True)
    g = torch.Generator().manual_seed(0)
    for step, shape in enumerate(shapes):
        x, dy = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
        gamma = torch.rand(gamma_shape(shape), generator=g) + 0.5
        results = []
        for run in (compiled, fn):
            inputs = [t.clone().requires_grad_() for t in (x, dy, gamma)]
            with torch.compiler.set_stance("fail_on_recompile" if step and run is compiled else "default"):
                loss = run(*inputs)
            results.append((loss, *torch.autograd.grad(loss, inputs)))
        torch.testing.assert_close(results[0], results[1])
    assert not counters["graph_break"]


@pytest.mark.parametrize(
    "training,momentum", [(True, 0.1), (False, 0.1), (True, None)], ids=["train", "eval", "train-momentum-none"]
)
def test_compile_fullgraph_matches_eager(training, momentum, device):
    model = _model(momentum).to(device).train(training)
    reference = copy.deepcopy(model)
    backend = CompileCounterWithBackend("inductor")
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    _assert_steps_match(compiled, model, reference, batches=[4, 4, 4], device=device)
    assert backend.frame_count == 1, "recompiled across steps"
    assert not counters["graph_break"]
    if training:
        assert int(model[1].num_batches_tracked) == 3


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_compile_dynamic_batch_does_not_recompile(training):
    model = _model(None if training else 0.1).train(training)
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, fullgraph=True, dynamic=True)
    _assert_steps_match(compiled, model, reference, batches=[4])
    with torch.compiler.set_stance("fail_on_recompile"):
        _assert_steps_match(compiled, model, reference, batches=[3, 5, 9])
    assert not counters["graph_break"]


def test_compile_mark_dynamic_batch_does_not_recompile():
    model = _model().train()
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, fullgraph=True)

    def run(x: torch.Tensor) -> torch.Tensor:
        torch._dynamo.mark_dynamic(x, 0)
        return compiled(x)

    _assert_steps_match(run, model, reference, batches=[4])
    with torch.compiler.set_stance("fail_on_recompile"):
        _assert_steps_match(run, model, reference, batches=[3, 5, 9])
    assert not counters["graph_break"]


def _export(model: torch.nn.Module) -> torch.export.ExportedProgram:
    example, _ = _inputs(4, 0)
    batch = torch.export.Dim("batch", min=2)
    return torch.export.export(model, (example,), dynamic_shapes=({0: batch},))


def _our_ops(program: torch.export.ExportedProgram) -> list:
    """The eval forwards, recorded as the overload that run_decompositions() makes core ATen (_library/frozen_composite.py)."""
    frozen = torch.ops.torch_bn_grad.batch_norm_forward.frozen_composite
    return [n.target for n in program.graph.nodes if n.target is frozen]


def test_export_eval_matches_eager():
    model = _model().eval()
    program = _export(model)
    assert len(_our_ops(program)) == 2
    exported = program.module()
    for seed, batch in enumerate([4, 3, 7]):
        x, _ = _inputs(batch, seed)
        torch.testing.assert_close(exported(x), model(x))


@pytest.mark.parametrize("momentum", [0.1, None], ids=["momentum", "momentum-none"])
def test_export_train_mutates_running_stats(momentum):
    model = _model(momentum).train()
    reference = copy.deepcopy(model)
    program = _export(model)
    # The functional form of the program lists every buffer update as an output.
    mutated = set(program.run_decompositions({}).graph_signature.buffers_to_mutate.values())
    assert mutated == {f"{i}.{name}" for i in (1, 5) for name in ("running_mean", "running_var", "num_batches_tracked")}
    exported = program.module()
    for seed, batch in enumerate([4, 3, 7]):
        x, _ = _inputs(batch, seed)
        torch.testing.assert_close(exported(x), reference(x))
    for name, ref in reference.named_buffers():
        torch.testing.assert_close(exported.get_buffer(name), ref, msg=lambda m: f"{name}: {m}")


_AOTI_SCRIPT = r"""
import sys, torch
import torch_bn_grad  # registers the operators the package calls
runner = torch._inductor.aoti_load_package(sys.argv[1])
cases = torch.load(sys.argv[2])
for x, expected in cases:
    torch.testing.assert_close(runner(x), expected)
print("ok", len(cases))
"""


def test_aot_inductor_package_runs_in_fresh_process(tmp_path):
    model = _model().eval()
    package = torch._inductor.aoti_compile_and_package(_export(model), package_path=str(tmp_path / "model.pt2"))
    cases = [(x, model(x).detach()) for x, _ in (_inputs(batch, seed) for seed, batch in enumerate([4, 3, 9]))]
    torch.save(cases, tmp_path / "cases.pt")
    root = os.path.dirname(os.path.dirname(torch_bn_grad.__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, "-c", _AOTI_SCRIPT, package, str(tmp_path / "cases.pt")],
        env=env, capture_output=True, text=True,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["ok", "3"]
