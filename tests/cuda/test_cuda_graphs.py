"""CUDA graphs: a training step of a model built of this library's modules,
plain and fused, captured with ``torch.cuda.graph`` and replayed, gives bitwise
the eager step's results (loss, parameters, running statistics); and the model
runs under ``torch.compile(mode="reduce-overhead")`` (inductor's CUDA graph
trees) with no graph skipped, bitwise equal to the same compiled model without
CUDA graphs. The capture runs with each CUDA variant on too. (Compiled
against eager: tests/compile/test_compile.py; five SGD steps at lr 0.1 drift
further apart than a fixed tolerance, through the convolutions' own compiled
code.)

Every step here allocates only through the caching allocator and never reads
a device value on the host, which is what capture requires.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch._dynamo.utils import counters

import torch_bn_grad

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")

WARMUP = 3  # eager steps on a side stream before capture, as torch's whole-network recipe does
REPLAYS = 4


def _model(fuse: bool, memory_format: torch.memory_format) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 3, padding=1, bias=False),
        torch.nn.BatchNorm2d(16),
        torch.nn.ReLU(),
        torch.nn.Conv2d(16, 32, 3, stride=2, padding=1, bias=False),
        torch.nn.BatchNorm2d(32, momentum=None),  # the cumulative average: a tensor factor
        torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(),
        torch.nn.Linear(32, 10),
        torch.nn.BatchNorm1d(10),
    )
    model = torch_bn_grad.convert_batchnorm(model, fuse=fuse)
    return model.cuda().to(memory_format=memory_format)


def _batches(count: int, memory_format: torch.memory_format) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator(device="cuda").manual_seed(1)
    return [(torch.randn(8, 3, 16, 16, device="cuda", generator=g).contiguous(memory_format=memory_format),
             torch.randint(0, 10, (8,), device="cuda", generator=g)) for _ in range(count)]


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _assert_bitwise(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], what: str) -> None:
    assert actual.keys() == expected.keys()
    for name, value in expected.items():
        assert torch.equal(actual[name], value), f"{what}: {name} differs"


@pytest.fixture(autouse=True)
def _deterministic_convolutions():
    """cuDNN's convolutions deterministic, so that only this library's kernels are under test."""
    with torch.backends.cudnn.flags(enabled=True, benchmark=False, deterministic=True):
        yield


VARIANT_SETS = [frozenset()] + [frozenset({name}) for name in torch_bn_grad.config.cuda_variant_names()]


@pytest.fixture(params=VARIANT_SETS, ids=lambda v: "+".join(sorted(v)) or "default")
def variants(request):
    """The CUDA variants on (docs/design.md, "CUDA variants"): none, then each alone."""
    before = torch_bn_grad.config.cuda_variants
    torch_bn_grad.config.cuda_variants = request.param
    yield request.param
    torch_bn_grad.config.cuda_variants = before


@pytest.mark.parametrize("memory_format", [torch.contiguous_format, torch.channels_last],
                         ids=["contiguous", "channels_last"])
@pytest.mark.parametrize("fuse", [False, True], ids=["plain", "fused"])
def test_captured_training_step_replays_bitwise_as_eager(fuse, memory_format, variants):
    eager = _model(fuse, memory_format)
    graphed = copy.deepcopy(eager)
    if fuse:
        assert any(isinstance(m, torch_bn_grad.nn.BatchNormAct2d) for m in graphed.modules())
    batches = _batches(WARMUP + REPLAYS, memory_format)

    def step(model, optimizer, x, target):
        optimizer.zero_grad(set_to_none=False)
        loss = torch.nn.functional.cross_entropy(model(x), target)
        loss.backward()
        optimizer.step()
        return loss

    eager_opt = torch.optim.SGD(eager.parameters(), lr=0.1, momentum=0.9)
    eager_losses = [step(eager, eager_opt, x, t).detach() for x, t in batches]

    opt = torch.optim.SGD(graphed.parameters(), lr=0.1, momentum=0.9)
    static_x, static_t = torch.empty_like(batches[0][0]), torch.empty_like(batches[0][1])
    losses = []
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for x, t in batches[:WARMUP]:
            static_x.copy_(x)
            static_t.copy_(t)
            losses.append(step(graphed, opt, static_x, static_t).detach().clone())
    torch.cuda.current_stream().wait_stream(side)

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_loss = step(graphed, opt, static_x, static_t)
    for x, t in batches[WARMUP:]:
        static_x.copy_(x)
        static_t.copy_(t)
        graph.replay()
        losses.append(static_loss.detach().clone())
    torch.cuda.synchronize()

    for i, (got, expected) in enumerate(zip(losses, eager_losses)):
        assert torch.equal(got, expected), f"loss of step {i}: {got.item()} != {expected.item()}"
    _assert_bitwise(_state(graphed), _state(eager), "after the replays")
    tracked = [m.num_batches_tracked.item() for m in graphed.modules() if hasattr(m, "num_batches_tracked")]
    assert tracked and all(n == WARMUP + REPLAYS for n in tracked)


@pytest.mark.parametrize("fuse", [False, True], ids=["plain", "fused"])
def test_reduce_overhead_compile_runs_as_cuda_graphs(fuse):
    torch._dynamo.reset()
    memory_format = torch.channels_last
    reference, graphed = _model(fuse, memory_format), _model(fuse, memory_format)
    compiled_ref = torch.compile(reference, mode="default")
    compiled = torch.compile(graphed, mode="reduce-overhead")
    batches = _batches(5, memory_format)
    counters.clear()
    for model, run in ((reference, compiled_ref), (graphed, compiled)):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for x, t in batches:
            torch.compiler.cudagraph_mark_step_begin()
            opt.zero_grad(set_to_none=True)
            torch.nn.functional.cross_entropy(run(x), t).backward()
            opt.step()
    torch.cuda.synchronize()
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])
    _assert_bitwise(_state(graphed), _state(reference), "reduce-overhead against default compile")
