"""``skip_nonfinite_stats`` in SyncBatchNorm: the whole batch's statistics come from
every rank's moments, so an inf on one rank makes them non-finite on all, and
every rank skips the update alike (bitwise the same buffers on each), with no
host synchronization; the next finite batch updates as torch's BatchNorm would
on the whole batch from the preserved state. Two spawned ranks over gloo, and a
world of one in this process (the group-statistics path of ``sync_batch_norm``).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import torch_bn_grad
from support.nonfinite_cases import CASES, CHANNELS, assert_as_torch, assert_bitwise, buffers, torch_from
from support.spawned_ranks import WORLD_SIZE, run_on_ranks

TIMEOUT_S = 240
POISONED_RANK = 1
# (masked, momentum, skip, compiled)
VARIANTS = {
    "plain": (False, 0.1, True, False),
    "plain-cumulative": (False, None, True, False),
    "masked-cumulative": (True, None, True, False),
    "compiled-cumulative": (False, None, True, True),
    "off": (False, 0.1, False, False),
}


def _case(masked: bool):
    return CASES["masked BatchNorm1d" if masked else "SyncBatchNorm"]


def _batch(masked: bool, step: int, rank: int) -> tuple[torch.Tensor, ...]:
    case, seed = _case(masked), 10 * step + rank
    return case.poisoned(seed, float("inf")) if step == 1 and rank == POISONED_RANK else case.batch(seed)


def _steps(rank: int) -> dict:
    """Each variant's three steps (finite, inf on one rank, finite) on this rank: buffers after each."""
    results = {}
    for name, (masked, momentum, skip, compiled) in VARIANTS.items():
        module = torch_bn_grad.nn.SyncBatchNorm(CHANNELS, momentum=momentum, skip_nonfinite_stats=skip)
        run = torch.compile(module, fullgraph=True, backend="aot_eager") if compiled else module
        states = []
        for step in range(3):
            run(*_batch(masked, step, rank)).sum().backward()
            states.append(buffers(module))
        results[name] = states
    return results


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    return run_on_ranks(_steps, (), tmp_path_factory.mktemp("nonfinite_sync"), TIMEOUT_S)


def _whole_batch(masked: bool, step: int) -> tuple[torch.Tensor, ...]:
    parts = [_batch(masked, step, rank) for rank in range(WORLD_SIZE)]
    return tuple(torch.cat(ts) for ts in zip(*parts))


@pytest.mark.parametrize("name", [n for n, v in VARIANTS.items() if v[2]])
def test_inf_on_one_rank_skips_on_every_rank(ranks, name):
    masked, momentum, _, _ = VARIANTS[name]
    for rank, found in enumerate(ranks):
        first, skipped, third = found[name]
        assert_bitwise(skipped, first, f"rank {rank} after the inf on rank {POISONED_RANK}")
        assert_bitwise(third, ranks[0][name][2], f"rank {rank} against rank 0")
    case = _case(masked)
    reference = torch_from(case, momentum, ranks[0][name][0])
    case.run_torch(reference, _whole_batch(masked, 2))
    assert_as_torch(ranks[0][name][2], buffers(reference), "the whole finite batch after the skipped one")


def test_off_every_rank_turns_nan(ranks):
    for rank, found in enumerate(ranks):
        assert not torch.isfinite(found["off"][1]["running_var"]).all(), f"rank {rank}"
        assert int(found["off"][1]["num_batches_tracked"]) == 2


@pytest.fixture
def world_of_one():
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("momentum", [0.1, None], ids=["momentum0.1", "cumulative"])
@pytest.mark.parametrize("masked", [False, True], ids=["plain", "masked"])
def test_world_of_one(world_of_one, masked, momentum):
    case = _case(masked)
    module = torch_bn_grad.nn.SyncBatchNorm(CHANNELS, momentum=momentum, skip_nonfinite_stats=True)
    tracked = module.num_batches_tracked

    def sync_step(batch):  # the group-statistics path, which a group of one leaves to the local one
        tracked.add_(1)
        factor = 1.0 / tracked.double() if momentum is None else momentum
        x, mask = batch if masked else (batch[0], None)
        return torch_bn_grad.distributed.sync_batch_norm(
            x, module.running_mean, module.running_var, module.weight, module.bias, factor, module.eps,
            world_of_one, mask=mask, skip_nonfinite_stats=True, num_batches_tracked=tracked)

    for run in (lambda batch: module(*batch), sync_step):
        module.reset_running_stats()
        states = []
        for batch in (case.batch(0), case.poisoned(1, float("-inf")), case.batch(2)):
            run(batch)
            states.append(buffers(module))
        assert_bitwise(states[1], states[0], "after the poisoned batch")
        reference = torch_from(case, momentum, states[0])
        case.run_torch(reference, case.batch(2))
        assert_as_torch(states[2], buffers(reference), "the finite batch after the skipped one")
