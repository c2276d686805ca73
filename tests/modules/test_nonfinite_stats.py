"""``skip_nonfinite_stats``: a training batch whose statistics are not finite (an inf
or NaN in the batch, pytorch/pytorch#90342) leaves ``running_mean``,
``running_var`` and ``num_batches_tracked`` bitwise as they were, decided on the
device; off (the default), the buffers turn NaN as torch's do. The step's output
is the same either way, and the next finite batch updates as torch's module would
from the preserved state (the cumulative average's factor included). Eager,
``torch.compile(fullgraph=True)``, TorchScript, and a captured CUDA graph.
SyncBatchNorm over a process group: tests/distributed/test_nonfinite_stats_distributed.py.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import torch_bn_grad
from support.nonfinite_cases import CASES, assert_as_torch, assert_bitwise, buffers, torch_from

MOMENTA = [0.1, None]
POISONS = [float("inf"), float("nan")]


def _three_steps(case, momentum, skip, poison, module=None, run=None):
    """A finite, a poisoned and a finite training step of ``module`` (a new one if None)
    through ``run`` (its forward if None); (module, buffers after each, outputs)."""
    module = module if module is not None else case.build(momentum, skip)
    run = run or (lambda batch: case.run(module, batch))
    states, outputs = [], []
    for batch in (case.batch(0), case.poisoned(1, poison), case.batch(2)):
        outputs.append(run(batch).detach())
        states.append(buffers(module))
    return module, states, outputs


@pytest.mark.parametrize("poison", POISONS, ids=["inf", "nan"])
@pytest.mark.parametrize("momentum", MOMENTA, ids=["momentum0.1", "cumulative"])
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_skipped_batch_leaves_buffers_and_the_next_updates_as_torch(case, momentum, poison):
    module, (first, skipped, third), outputs = _three_steps(case, momentum, True, poison)
    assert_bitwise(skipped, first, "after the poisoned batch")
    reference = torch_from(case, momentum, first)  # torch's module from the preserved state
    case.run_torch(reference, case.batch(2))
    assert_as_torch(third, buffers(reference), "the finite batch after the skipped one")
    assert int(third["num_batches_tracked"]) == 2
    _, _, unguarded = _three_steps(case, momentum, False, poison)
    for got, expected in zip(outputs, unguarded):  # the outputs are not the switch's business
        assert torch.equal(got.nan_to_num(7.0), expected.nan_to_num(7.0))
    module.eval()
    assert torch.isfinite(case.run(module, case.batch(3))).all()


@pytest.mark.parametrize("momentum", MOMENTA, ids=["momentum0.1", "cumulative"])
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_off_by_default_buffers_turn_nan_as_torchs(case, momentum):
    module = case.build(momentum, None)
    assert module.skip_nonfinite_stats is False
    reference = case.torch_build(momentum)
    for batch in (case.batch(0), case.poisoned(1, float("inf")), case.batch(2)):
        case.run(module, batch)
        case.run_torch(reference, batch)
    state = buffers(module)
    assert torch.isnan(state["running_var"]).any()
    assert_as_torch(state, buffers(reference), "without the switch")


@pytest.mark.parametrize("momentum", MOMENTA, ids=["momentum0.1", "cumulative"])
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_finite_batches_update_bitwise_as_without_the_switch(case, momentum):
    states = []
    for skip in (True, False):
        module = case.build(momentum, skip)
        for seed in range(3):
            case.run(module, case.batch(seed))
        states.append(buffers(module))
    assert_bitwise(states[0], states[1], "finite batches, switch on against off")


def test_masked_padding_holding_inf_does_not_skip():
    case = CASES["masked BatchNorm1d"]
    module = case.build(0.1, True)
    x, mask = case.batch(0)
    x = torch.where(mask.unsqueeze(1), x, float("inf"))
    module(x, mask)
    assert int(module.num_batches_tracked) == 1
    reference = case.torch_build(0.1)
    case.run_torch(reference, (x, mask))
    assert_as_torch(buffers(module), buffers(reference), "inf only in the padding")


def test_batch_without_valid_positions_counts_as_torchs_empty_batch():
    module = torch_bn_grad.nn.BatchNorm1d(3, skip_nonfinite_stats=True)
    x = torch.randn(2, 3, 4)
    before = buffers(module)
    module(x, torch.zeros(2, 4, dtype=torch.bool))
    assert int(module.num_batches_tracked) == 1  # counted, as torch counts an empty batch
    assert torch.equal(module.running_mean, before["running_mean"])


def test_half_precision_buffers_skip_a_variance_they_cannot_hold():
    module = torch_bn_grad.nn.BatchNorm2d(2, skip_nonfinite_stats=True).half()
    module(torch.randn(4, 2, 3, 3).half())
    before = buffers(module)
    module(torch.randn(4, 2, 3, 3).half() * 1000)  # finite data; variance past float16's 65504
    assert_bitwise(buffers(module), before, "float16 buffers")


@pytest.mark.parametrize("activation", [False, True], ids=["batch_norm", "batch_norm_act"])
def test_functional_skips_and_gives_the_count_back(activation):
    fn = torch_bn_grad.functional.batch_norm_act if activation else torch_bn_grad.functional.batch_norm
    mean, var, tracked = torch.zeros(3), torch.ones(3), torch.tensor(5)
    finite = torch.randn(4, 3, 5)
    x = finite.clone()
    x[2, 0, 1] = float("-inf")
    fn(x, mean, var, training=True, skip_nonfinite_stats=True, num_batches_tracked=tracked)
    assert torch.equal(mean, torch.zeros(3)) and torch.equal(var, torch.ones(3)) and int(tracked) == 4
    fn(finite, mean, var, training=True, skip_nonfinite_stats=True)
    torch.testing.assert_close(mean, 0.1 * finite.mean((0, 2)))


@pytest.mark.parametrize("momentum", MOMENTA, ids=["momentum0.1", "cumulative"])
@pytest.mark.parametrize("case", ["BatchNorm2d", "BatchNormAct2d", "masked BatchNorm1d"])
def test_compiled_fullgraph_skips_as_eager(case, momentum):
    torch._dynamo.reset()
    case = CASES[case]
    module = case.build(momentum, True)
    compiled = torch.compile(module, fullgraph=True, backend="aot_eager")
    _, (first, skipped, third), outputs = _three_steps(case, momentum, True, float("inf"), module,
                                                       run=lambda batch: case.run(compiled, batch))
    _, eager_states, eager_outputs = _three_steps(case, momentum, True, float("inf"))
    assert_bitwise(skipped, first, "compiled, after the poisoned batch")
    assert_bitwise(third, eager_states[2], "compiled against eager")
    for got, expected in zip(outputs, eager_outputs):
        torch.testing.assert_close(got, expected, equal_nan=True)


def test_inductor_compiled_skips():
    torch._dynamo.reset()
    case = CASES["BatchNorm2d"]
    module = case.build(None, True)
    compiled = torch.compile(module, fullgraph=True)
    _, (first, skipped, third), _ = _three_steps(case, None, True, float("nan"), module,
                                                 run=lambda batch: case.run(compiled, batch))
    assert_bitwise(skipped, first, "inductor, after the poisoned batch")
    reference = torch_from(case, None, first)
    case.run_torch(reference, case.batch(2))
    assert_as_torch(third, buffers(reference), "inductor, the finite batch after the skipped one")


@pytest.mark.parametrize("masked", [False, True], ids=["plain", "masked"])
def test_scripted_module_skips_as_eager(masked):
    case = CASES["masked BatchNorm1d" if masked else "BatchNorm2d"]
    scripted = torch.jit.script(case.build(None, True))
    _, states, outputs = _three_steps(case, None, True, float("inf"), scripted, run=lambda batch: scripted(*batch))
    _, eager_states, eager_outputs = _three_steps(case, None, True, float("inf"))
    assert_bitwise(states[1], states[0], "scripted, after the poisoned batch")
    assert_bitwise(states[2], eager_states[2], "scripted against eager")
    for got, expected in zip(outputs, eager_outputs):
        assert torch.equal(got.nan_to_num(7.0), expected.nan_to_num(7.0))


def test_switch_is_an_attribute_kept_through_conversion_not_state():
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 1), torch.nn.BatchNorm2d(4), torch.nn.ReLU())
    keys = list(model.state_dict())
    model = torch_bn_grad.convert_batchnorm(model, skip_nonfinite_stats=True)
    assert model[1].skip_nonfinite_stats is True and list(model.state_dict()) == keys
    fused = torch_bn_grad.convert_batchnorm(model, fuse=True)
    assert isinstance(fused[1], torch_bn_grad.nn.BatchNormAct2d) and fused[1].skip_nonfinite_stats is True
    assert torch_bn_grad.convert_batchnorm(fused, skip_nonfinite_stats=False)[1].skip_nonfinite_stats is False
    sync = torch_bn_grad.nn.SyncBatchNorm.convert_sync_batchnorm(torch.nn.BatchNorm1d(2))
    assert sync.skip_nonfinite_stats is False


def test_config_default_and_argument_checks():
    previous = torch_bn_grad.config.skip_nonfinite_stats
    try:
        torch_bn_grad.config.skip_nonfinite_stats = True
        assert torch_bn_grad.nn.BatchNormAct1d(2).skip_nonfinite_stats is True
        assert torch_bn_grad.convert_batchnorm(torch.nn.BatchNorm3d(2)).skip_nonfinite_stats is True
        assert torch_bn_grad.nn.BatchNorm2d(2, skip_nonfinite_stats=False).skip_nonfinite_stats is False
    finally:
        torch_bn_grad.config.skip_nonfinite_stats = previous
    with pytest.raises(TypeError, match="config.skip_nonfinite_stats must be a bool, got 1"):
        torch_bn_grad.config.skip_nonfinite_stats = 1
    with pytest.raises(TypeError, match="BatchNorm2d: skip_nonfinite_stats must be a bool or None, got 'yes'"):
        torch_bn_grad.nn.BatchNorm2d(2, skip_nonfinite_stats="yes")
    model = torch.nn.Sequential(torch.nn.BatchNorm2d(2))
    with pytest.raises(TypeError, match="convert_batchnorm: skip_nonfinite_stats"):
        torch_bn_grad.convert_batchnorm(model, skip_nonfinite_stats=1)
    assert type(model[0]) is torch.nn.BatchNorm2d  # checked before anything changed


@pytest.mark.parametrize("value,expected", [("1", True), ("0", False), ("", False)])
def test_environment_variable_sets_the_default(value, expected):
    env = {**os.environ, "TORCH_BN_GRAD_SKIP_NONFINITE_STATS": value}
    code = "import torch_bn_grad; print(torch_bn_grad.nn.BatchNorm2d(2).skip_nonfinite_stats)"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str(expected)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
@pytest.mark.parametrize("fuse", [False, True], ids=["plain", "fused"])
def test_captured_step_skips_on_replay(fuse):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
                                torch.nn.Conv2d(8, 8, 3, padding=1), torch.nn.BatchNorm2d(8, momentum=None))
    model = torch_bn_grad.convert_batchnorm(model, fuse=fuse, skip_nonfinite_stats=True).cuda()
    reference = {k: v.clone() for k, v in model.state_dict().items()}
    static_x = torch.randn(4, 3, 8, 8, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up, as torch's recipe does; then back to the start
        model(static_x).sum().backward()
    torch.cuda.current_stream().wait_stream(side)
    model.load_state_dict(reference)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        model(static_x).sum().backward()
    bns = [m for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    g = torch.Generator(device="cuda").manual_seed(1)
    static_x.copy_(torch.randn(4, 3, 8, 8, device="cuda", generator=g))
    graph.replay()
    after_finite = [buffers(m) for m in bns]
    static_x[0, 1, 2, 3] = float("inf")
    graph.replay()
    for bn, state in zip(bns, after_finite):
        assert_bitwise(buffers(bn), state, "a replay with an inf")
    static_x.copy_(torch.randn(4, 3, 8, 8, device="cuda", generator=g))
    graph.replay()
    torch.cuda.synchronize()
    assert all(int(bn.num_batches_tracked) == 2 for bn in bns)
    assert all(torch.isfinite(bn.running_var).all() for bn in bns)
