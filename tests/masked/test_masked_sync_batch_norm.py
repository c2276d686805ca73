"""Masked SyncBatchNorm over 2 processes (gloo on 127.0.0.1; on CUDA tensors
too, the ranks sharing a GPU) against the float64 gather -> batch norm ->
scatter reference on the whole batch: outputs, input gradients, summed
parameter gradients and running statistics, with ranks holding different
valid counts, one holding only padding, and neither holding any."""

from __future__ import annotations

import pytest
import torch

import torch_bn_grad
from support.masked_reference import gathered_forward, lengths_mask
from support.reference import DEVICES
from support.spawned_ranks import WORLD_SIZE, run_on_ranks

# Per scenario: the lengths of each rank's sequences (frames of 12).
SCENARIOS = {
    "uneven": ([12, 5, 9], [3, 7]),
    "rank-of-padding": ([12, 4], [0, 0, 0]),
    "all-padding": ([0, 0], [0]),
}
assert all(len(per_rank) == WORLD_SIZE for per_rank in SCENARIOS.values())
CHANNELS, FRAMES = 4, 12
TIMEOUT_S = 180


def batch(lengths: list[int], seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(len(lengths), CHANNELS, FRAMES, generator=g, dtype=torch.float64) + 2.0
    dy = torch.randn(x.shape, generator=g, dtype=torch.float64)
    mask = lengths_mask(lengths, FRAMES)
    x = torch.where(mask.unsqueeze(1), x, float("nan"))  # padding must not matter
    return x, dy, mask


def _train(rank: int, device: str) -> dict:
    """Each scenario's step on this rank's part, on `device`; results on the CPU."""
    if device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    results = {}
    for name, per_rank in SCENARIOS.items():
        m = torch_bn_grad.nn.SyncBatchNorm(CHANNELS).double().to(device)
        x, dy, mask = (t.to(device) for t in batch(per_rank[rank], seed=10 * list(SCENARIOS).index(name) + rank))
        x.requires_grad_()
        out = m(x, mask)
        out.backward(dy)
        found = dict(out=out.detach(), grad=x.grad, weight_grad=m.weight.grad, bias_grad=m.bias.grad,
                     running_mean=m.running_mean, running_var=m.running_var)
        results[name] = {key: value.cpu() for key, value in found.items()}
    return results


@pytest.fixture(scope="module", params=DEVICES)
def ranks(request, tmp_path_factory):
    """What each rank found, on gloo (which carries CUDA tensors through host memory)."""
    out = tmp_path_factory.mktemp(f"masked_sync_{request.param}")
    return run_on_ranks(_train, (request.param,), out, TIMEOUT_S, backend="gloo")


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_matches_the_whole_batch(ranks, name):
    parts = [batch(SCENARIOS[name][r], seed=10 * list(SCENARIOS).index(name) + r) for r in range(WORLD_SIZE)]
    x = torch.cat([p[0] for p in parts]).requires_grad_()
    dy = torch.cat([p[1] for p in parts])
    mask = torch.cat([p[2] for p in parts])
    ref_m = torch.nn.BatchNorm1d(CHANNELS).double()
    weight = ref_m.weight.detach().clone().requires_grad_()
    bias = ref_m.bias.detach().clone().requires_grad_()
    outs = [r[name] for r in ranks]
    if mask.any():
        out, mean, var, count = gathered_forward(x, mask, weight, bias, 1e-5)
        out.backward(dy)
        expected_out, expected_grad = out.detach(), x.grad
        unbiased = var * count / max(count - 1, 1)
        running_mean = 0.1 * mean.detach()
        running_var = 0.9 + 0.1 * unbiased.detach()
        weight_grad, bias_grad = weight.grad, bias.grad
    else:
        expected_out = expected_grad = torch.zeros_like(x)
        running_mean, running_var = torch.zeros(CHANNELS, dtype=torch.float64), torch.ones(CHANNELS, dtype=torch.float64)
        weight_grad = bias_grad = torch.zeros(CHANNELS, dtype=torch.float64)
    torch.testing.assert_close(torch.cat([o["out"] for o in outs]), expected_out)
    torch.testing.assert_close(torch.cat([o["grad"] for o in outs]), expected_grad)
    torch.testing.assert_close(sum(o["weight_grad"] for o in outs), weight_grad)
    torch.testing.assert_close(sum(o["bias_grad"] for o in outs), bias_grad)
    for o in outs:
        torch.testing.assert_close(o["running_mean"], running_mean)
        torch.testing.assert_close(o["running_var"], running_var)
