"""SyncBatchNorm over 2 processes (gloo on 127.0.0.1) against torch's
single-process BatchNorm on the whole batch: outputs, input gradients, running
statistics and summed parameter gradients, over several training steps and
then in eval mode; even, uneven, empty-rank and all-empty batches; and the
same under torch.compile(fullgraph=True).

One pair of processes runs every scenario (start-up dominates); each worker
saves what it saw, and the tests compare it here. Every wait is bounded.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import pytest
import torch
import torch.distributed as dist
from torch._dynamo.utils import counters

import torch_bn_grad
from support.recorded_steps import record_steps
from support.spawned_ranks import run_on_ranks
from support.reference import TOLERANCES, assert_modules_match

TIMEOUT_S = 240  # the whole run, compilation included
STEPS = 3


@dataclass(frozen=True)
class Scenario:
    """A model slice: a torch BatchNorm of `kind`, per-rank batch sizes, item shape (C, *X)."""

    kind: str  # "1d" | "2d" | "3d"
    sizes: tuple[int, int]
    item_shape: tuple[int, ...]
    dtype: torch.dtype = torch.float64
    param_dtype: Optional[torch.dtype] = None  # None: dtype
    options: dict = field(default_factory=dict)
    channels_last: bool = False
    backend: Optional[str] = None  # torch.compile(fullgraph=True) with this backend
    dynamic: Optional[bool] = None  # torch.compile's dynamic=
    group: str = "world"  # "world" (process_group=None) | "pair" (a new group of both ranks)

    def module(self) -> torch.nn.modules.batchnorm._BatchNorm:
        cls = {"1d": torch.nn.BatchNorm1d, "2d": torch.nn.BatchNorm2d, "3d": torch.nn.BatchNorm3d}[self.kind]
        bn = cls(self.item_shape[0], **self.options).to(self.param_dtype or self.dtype)
        if bn.affine:
            g = torch.Generator().manual_seed(1)
            with torch.no_grad():
                bn.weight.uniform_(0.5, 1.5, generator=g)
                bn.bias.normal_(generator=g)
        return bn

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole batch (all ranks' slices, in rank order) and its upstream gradient."""
        g = torch.Generator().manual_seed(100 + step)
        shape = (sum(self.sizes), *self.item_shape)
        x = torch.randn(shape, generator=g, dtype=torch.float64) * (step + 1) + 3 * step
        dy = torch.randn(shape, generator=g, dtype=torch.float64)
        x, dy = x.to(self.dtype), dy.to(self.dtype)
        if self.channels_last:
            fmt = torch.channels_last if x.dim() == 4 else torch.channels_last_3d
            x = x.contiguous(memory_format=fmt)
        return x, dy

    def local(self, t: torch.Tensor, rank: int) -> torch.Tensor:
        start = sum(self.sizes[:rank])
        return t[start:start + self.sizes[rank]]


SCENARIOS = {
    "even-2d-subgroup": Scenario("2d", (3, 3), (4, 5, 3), group="pair"),
    "uneven-1d-momentum-none": Scenario("1d", (7, 2), (5,), options=dict(momentum=None)),
    "uneven-2d-float32-channels_last": Scenario("2d", (5, 1), (6, 3, 4), dtype=torch.float32, channels_last=True),
    "uneven-1d-bfloat16": Scenario("1d", (6, 3), (8, 5), dtype=torch.bfloat16),
    "uneven-1d-float16-float32-parameters": Scenario("1d", (2, 7), (8,), dtype=torch.float16,
                                                     param_dtype=torch.float32),
    "empty-rank-3d": Scenario("3d", (4, 0), (3, 2, 3, 2)),
    "empty-rank-no-affine": Scenario("1d", (0, 6), (4, 3), options=dict(affine=False)),
    "one-sample-per-rank": Scenario("1d", (1, 1), (3,)),
    "all-empty": Scenario("2d", (0, 0), (3, 2, 2)),
    # aot_eager: dynamo and AOTAutograd trace forward and backward; inductor's code generation is slow.
    "compiled-uneven-2d": Scenario("2d", (4, 2), (4, 3, 3), backend="aot_eager"),
    "compiled-dynamic-empty-rank-momentum-none": Scenario(
        "1d", (0, 5), (3, 4), options=dict(momentum=None), backend="aot_eager", dynamic=True),
}
INDUCTOR_SCENARIOS = {
    "inductor-uneven-3d-float32": Scenario("3d", (3, 1), (4, 2, 3, 3), dtype=torch.float32, backend="inductor"),
    "inductor-dynamic-empty-rank": Scenario("2d", (5, 0), (3, 4, 4), backend="inductor", dynamic=True),
}
SUITES = {"default": SCENARIOS, "inductor": INDUCTOR_SCENARIOS}


# ------------------------------------------------------------------ the workers
def _run_scenario(scenario: Scenario, rank: int, groups: dict) -> dict:
    """Training steps then an eval step with our SyncBatchNorm on this rank's slice."""
    model = torch_bn_grad.convert_batchnorm(scenario.module(), sync=True, process_group=groups[scenario.group])
    assert type(model) is torch_bn_grad.nn.SyncBatchNorm
    forward = model
    if scenario.backend:
        counters.clear()
        forward = torch.compile(model, backend=scenario.backend, fullgraph=True, dynamic=scenario.dynamic)
    batches = ((scenario.local(x, rank), scenario.local(dy, rank)) for x, dy in map(scenario.batch, range(STEPS)))
    result = record_steps(forward, model, batches)
    if scenario.backend:
        # Graphs compiled for training: a recompilation would add one (dynamo's
        # restarts of an analysis do not).
        result["graphs"] = counters["stats"]["unique_graphs"]
    model.eval()
    with torch.no_grad():
        result["eval_output"] = forward(scenario.local(scenario.batch(STEPS)[0], rank))
    if scenario.backend:
        result["graph_breaks"] = sum(counters["graph_break"].values())
    return result


def _run_suite(rank: int, suite: str) -> dict:
    groups = {"world": None, "pair": dist.new_group([0, 1])}
    return {name: _run_scenario(s, rank, groups) for name, s in SUITES[suite].items()}


def _spawn(suite: str, out_dir: Path) -> list[dict]:
    """Runs a suite of scenarios on the spawned processes; each rank's results."""
    return run_on_ranks(_run_suite, (suite,), out_dir, TIMEOUT_S)


@pytest.fixture(scope="module")
def rank_results(tmp_path_factory) -> list[dict]:
    """Every default scenario's results on each rank, from one pair of spawned processes."""
    return _spawn("default", tmp_path_factory.mktemp("sync"))


# ------------------------------------------------------------------ the reference and the checks
def _reference(scenario: Scenario) -> dict:
    """torch's BatchNorm in one process on the whole batch, in float64."""
    model = scenario.module().double()
    batches = ((x.double(), dy.double()) for x, dy in map(scenario.batch, range(STEPS)))
    result = record_steps(model, model, batches)
    model.eval()
    with torch.no_grad():
        result["eval_output"] = model(scenario.batch(STEPS)[0].double())
    return result


def _close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str, scale: float = 1) -> None:
    """`actual` (of `dtype`) against the float64 reference, with `dtype`'s tolerance, atol times `scale`."""
    tol = TOLERANCES[dtype]
    torch.testing.assert_close(actual.double(), expected.double(), atol=tol["atol"] * scale, rtol=tol["rtol"],
                               msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("name", SCENARIOS)
def test_matches_single_process_on_whole_batch(rank_results, name):
    _check_against_whole_batch(SCENARIOS[name], [r[name] for r in rank_results])


def _check_against_whole_batch(scenario: Scenario, per_rank: list[dict]) -> None:
    ref = _reference(scenario)
    dt, param_dt = scenario.dtype, scenario.param_dtype or scenario.dtype
    count = sum(scenario.sizes) * math.prod(scenario.item_shape[1:])  # per channel
    for step in range(STEPS):
        for rank, got in enumerate(per_rank):
            where = f"step {step}, rank {rank}"
            _close(got["outputs"][step], scenario.local(ref["outputs"][step], rank), dt, f"output, {where}")
            _close(got["input_grads"][step], scenario.local(ref["input_grads"][step], rank), dt,
                   f"input gradient, {where}", scale=2)
            for name, ref_buffer in ref["running"][step].items():
                _close(got["running"][step][name], ref_buffer, param_dt, f"running statistic {name}, {where}")
        for name, ref_grad in ref["param_grads"][step].items():
            summed = sum(got["param_grads"][step][name].double() for got in per_rank)
            _close(summed, ref_grad, param_dt, f"parameter {name} gradient summed over ranks, step {step}",
                   scale=count)  # sums of `count` terms
    for rank, got in enumerate(per_rank):
        _close(got["eval_output"], scenario.local(ref["eval_output"], rank), dt, f"eval output, rank {rank}")
    if scenario.channels_last:
        assert all(g["outputs"][0].is_contiguous(memory_format=torch.channels_last) for g in per_rank)


def test_empty_whole_batch_leaves_running_stats(rank_results):
    fresh = SCENARIOS["all-empty"].module()
    for got in rank_results:
        running = got["all-empty"]["running"][-1]
        assert torch.equal(running["running_mean"], fresh.running_mean)
        assert torch.equal(running["running_var"], fresh.running_var)
        assert running["num_batches_tracked"].item() == STEPS


@pytest.mark.parametrize("name", [n for n, s in SCENARIOS.items() if s.backend])
def test_compiles_into_one_graph_without_breaks(rank_results, name):
    for got in rank_results:
        assert got[name]["graph_breaks"] == 0
        assert got[name]["graphs"] == 1


@pytest.mark.slow
def test_inductor_compiled_matches_single_process(tmp_path):
    rank_results = _spawn("inductor", tmp_path)
    for name, scenario in INDUCTOR_SCENARIOS.items():
        per_rank = [r[name] for r in rank_results]
        _check_against_whole_batch(scenario, per_rank)
        assert all(got["graph_breaks"] == 0 and got["graphs"] == 1 for got in per_rank), name


# ------------------------------------------------------------------ without a process group
def test_without_process_group_is_a_local_batchnorm():
    assert not dist.is_initialized()
    ref = torch.nn.BatchNorm2d(3, momentum=None).double()
    ours = torch_bn_grad.convert_batchnorm(copy.deepcopy(ref), sync=True)
    assert type(ours) is torch_bn_grad.nn.SyncBatchNorm
    x = torch.randn(4, 3, 2, 2, dtype=torch.float64)
    for mode in ("train", "eval"):
        getattr(ref, mode)()
        getattr(ours, mode)()
        assert_modules_match(ref, ours, x)
        torch.testing.assert_close(ours.running_var, ref.running_var)


def test_sync_batchnorm_is_torchs_and_converts():
    m = torch_bn_grad.nn.SyncBatchNorm(4, eps=1e-3, momentum=0.2, process_group=None, bias=False)
    # Not a torch.nn.SyncBatchNorm: DistributedDataParallel refuses those in CPU modules.
    assert isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and not isinstance(m, torch.nn.SyncBatchNorm)
    assert m.bias is None and m.eps == 1e-3 and m.momentum == 0.2 and m.process_group is None
    assert set(m.state_dict()) == set(torch.nn.SyncBatchNorm(4, bias=False).state_dict())
    with pytest.raises(ValueError, match="expected at least 2D input"):
        m(torch.randn(4))
    with pytest.raises(ValueError, match="non-zero"):
        torch_bn_grad.nn.SyncBatchNorm(0)(torch.randn(2, 0))

    group = object()  # a stand-in: the conversion only stores it
    net = torch.nn.Sequential(torch.nn.BatchNorm1d(4), torch.nn.SyncBatchNorm(4, process_group=group),
                              torch.nn.BatchNorm3d(4).eval())
    weight = net[0].weight
    torch_bn_grad.convert_batchnorm(net)  # sync=False: only torch's SyncBatchNorm becomes ours
    assert type(net[0]) is torch_bn_grad.nn.BatchNorm1d and net[0].weight is weight
    assert type(net[1]) is torch_bn_grad.nn.SyncBatchNorm and net[1].process_group is group
    other = object()
    converted = torch_bn_grad.nn.SyncBatchNorm.convert_sync_batchnorm(
        torch.nn.Sequential(torch.nn.BatchNorm3d(4).eval()), process_group=other)
    assert type(converted[0]) is torch_bn_grad.nn.SyncBatchNorm
    assert converted[0].process_group is other and not converted[0].training
    root = torch_bn_grad.convert_batchnorm(torch.nn.BatchNorm2d(4), sync=True)
    assert type(root) is torch_bn_grad.nn.SyncBatchNorm and root.process_group is None
    assert torch_bn_grad.convert_batchnorm(root, sync=True) is root
