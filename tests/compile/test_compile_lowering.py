"""The operators' lowering under torch.compile's inductor backend (torch_bn_grad._compile.lowering, registered by _inductor).

Compiled models and operators against eager mode: values, gradients and running
statistics, in both memory formats and in float32 and bfloat16; the forms that
stay opaque; the switch ``torch_bn_grad.config.compile_lowering``.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch._dynamo.utils import counters
from torch._inductor.utils import run_and_get_code

import torch_bn_grad
from support.compile_steps import fresh_dynamo, sgd_step  # noqa: F401  (fresh_dynamo: an autouse fixture)
from support.reference import normalization_inputs
from torch_bn_grad import config
from torch_bn_grad._compile import inductor as _inductor

FORWARD_OPS = ("torch.ops.torch_bn_grad.batch_norm_forward",)
BACKWARD_OPS = ("torch.ops.torch_bn_grad.batch_norm_backward",)
OPS = FORWARD_OPS + BACKWARD_OPS
TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.bfloat16: dict(atol=3e-2, rtol=2e-2),
       torch.float64: dict(atol=1e-12, rtol=1e-12), torch.float16: dict(atol=2e-3, rtol=2e-3)}


def _extern_calls(code: list[str], ops=OPS) -> int:
    """How many calls of this library's operators `ops` inductor's generated code makes."""
    return sum(src.count(f"{op}.default(") for src in code for op in ops)


def _model(dtype: torch.dtype, memory_format: torch.memory_format) -> torch.nn.Module:
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
        torch.nn.Conv2d(8, 8, 3, padding=1), torch.nn.BatchNorm2d(8, momentum=None), torch.nn.ReLU(),
        torch.nn.Flatten(), torch.nn.Linear(8 * 36, 5), torch.nn.BatchNorm1d(5),
    )
    with torch.no_grad():
        for bn in (model[1], model[4], model[8]):
            bn.weight.uniform_(0.5, 1.5, generator=g)
            bn.bias.normal_(generator=g)
            bn.running_mean.normal_(generator=g)
            bn.running_var.uniform_(0.5, 2.0, generator=g)
    return torch_bn_grad.convert_batchnorm(model).to(dtype=dtype, memory_format=memory_format)


def _compare(compiled, model, reference, dtype, memory_format, batches):
    tol = TOL[dtype]
    for seed, batch in enumerate(batches):
        g = torch.Generator().manual_seed(seed)
        x = (torch.randn(batch, 3, 6, 6, generator=g) * 2 + 0.5).to(dtype).contiguous(memory_format=memory_format)
        target = torch.randint(0, 5, (batch,), generator=g)
        out, grads = sgd_step(compiled, model, x, target, backward=model.training)
        ref_out, ref_grads = sgd_step(reference, reference, x, target, backward=reference.training)
        torch.testing.assert_close(out, ref_out, **tol)
        assert out.is_contiguous(memory_format=torch.contiguous_format if out.dim() < 4 else memory_format)
        for grad, ref_grad in zip(grads, ref_grads):
            torch.testing.assert_close(grad, ref_grad, **tol)
        # Each step starts from the same parameters: the compiled forward rounds
        # the statistics its own way, and in a few SGD steps of a batch of 4
        # (bfloat16 parameters) those last-bit differences grow past any
        # fixed tolerance (an AVX2 machine: 0.31 on a conv weight's grad of
        # scale 2 by the third step, 0.016 in the first).
        with torch.no_grad():
            for p, ref in zip(model.parameters(), reference.parameters()):
                p.copy_(ref)
    for (name, t), (_, ref) in zip(model.state_dict().items(), reference.state_dict().items()):
        torch.testing.assert_close(t, ref, **tol, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_lowered_model_matches_eager(training, layout, dtype):
    """Inductor fuses the rewritten forward operators (no extern call is left;
    on CPU a training backward stays this library's kernel, one call per batch
    norm) and the compiled steps match eager mode: outputs, gradients, running
    statistics."""
    memory_format = torch.channels_last if layout == "channels_last" else torch.contiguous_format
    model = _model(dtype, memory_format).train(training)
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, fullgraph=True)
    _, code = run_and_get_code(_compare, compiled, model, reference, dtype, memory_format, [4])
    assert _inductor.is_registered()
    assert _extern_calls(code, FORWARD_OPS) == 0
    assert _extern_calls(code, BACKWARD_OPS) == (3 if training else 0)
    _compare(compiled, model, reference, dtype, memory_format, [4, 4])
    assert not counters["graph_break"]


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_lowered_dynamic_batch_does_not_recompile(training):
    model = _model(torch.float32, torch.contiguous_format).train(training)
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, fullgraph=True, dynamic=True)
    _, code = run_and_get_code(_compare, compiled, model, reference, torch.float32, torch.contiguous_format, [4])
    assert _extern_calls(code, FORWARD_OPS) == 0
    assert _extern_calls(code, BACKWARD_OPS) == (3 if training else 0)
    with torch.compiler.set_stance("fail_on_recompile"):
        _compare(compiled, model, reference, torch.float32, torch.contiguous_format, [3, 5, 9])
    assert not counters["graph_break"]


def test_switch_keeps_the_operators_opaque():
    config.compile_lowering = False
    model = _model(torch.float32, torch.contiguous_format).train()
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, fullgraph=True)
    _, code = run_and_get_code(_compare, compiled, model, reference, torch.float32, torch.contiguous_format, [4])
    assert _extern_calls(code) >= 6  # three forwards, three backwards
    assert not counters["graph_break"]


def test_switch_enters_the_compile_cache_key():
    import torch._inductor.config as inductor_config

    assert _inductor.ensure_registered()
    for value in (False, True):
        config.compile_lowering = value
        marked = inductor_config.unsafe_marked_cacheable_functions
        assert marked["torch_bn_grad:compile_lowering"].split(":")[0] == ("on" if value else "off")
    with pytest.raises(TypeError):
        config.compile_lowering = 1


def test_eager_and_export_keep_the_operators():
    """Registered with inductor, the rewrite changes neither eager mode nor torch.export."""
    assert _inductor.ensure_registered()
    model = _model(torch.float32, torch.contiguous_format).eval()
    x = torch.randn(4, 3, 6, 6)
    program = torch.export.export(model, (x,))
    targets = [n.target for n in program.graph.nodes]
    assert targets.count(torch.ops.torch_bn_grad.batch_norm_forward.frozen_composite) == 3  # the eval forward
    torch.testing.assert_close(program.module()(x), model(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_lowered_training_forward_takes_this_librarys_statistics(layout, dtype):
    """On CPU the lowered training forward reduces with batch_norm_stats_affine:
    its mean and variance are eager mode's, bit for bit (so the running
    statistics are too), whatever layout inductor gives the convolution output."""
    x, gamma, beta = normalization_inputs((8, 6, 7, 5), dtype, layout, seed=3, scale=4, offset=50)

    def fn(x, gamma, beta):
        return torch_bn_grad.batch_norm_forward(torch.relu(x), gamma, beta, epsilon=1e-3)

    got, code = run_and_get_code(torch.compile(fn, fullgraph=True), x, gamma, beta)
    expected = fn(x, gamma, beta)
    assert sum(src.count("torch.ops.torch_bn_grad.batch_norm_stats_affine.default(") for src in code) == 1
    assert _extern_calls(code) == 0
    assert torch.equal(got[1], expected[1]) and torch.equal(got[2], expected[2])
    assert got[0].stride() == expected[0].stride()
    torch.testing.assert_close(got[0], expected[0], **TOL[dtype])
    assert not counters["graph_break"]


# (shape, data_format, statistics' shape as a function of the shape)
FORMS = {
    "NCX-2d": ((5, 3), "NCX", lambda s: (s[1],)),
    "NCX-4d": ((4, 3, 5, 6), "NCX", lambda s: (s[1],)),
    "NCX-5d": ((2, 3, 4, 5, 3), "NCX", lambda s: (s[1],)),
    "NXC-4d": ((4, 5, 6, 3), "NXC", lambda s: (s[-1],)),
    "broadcast": ((4, 3, 5, 6), "NCX", lambda s: (1, s[1], s[2], 1)),
    "broadcast-rank1": ((7,), "NCX", lambda s: (1,)),
}
LAYOUTS = {
    "contiguous": lambda t: t.contiguous(),
    "channels_last": lambda t: t.contiguous(memory_format=torch.channels_last) if t.dim() == 4 else (
        t.contiguous(memory_format=torch.channels_last_3d) if t.dim() == 5 else t),
    "strided": lambda t: t.transpose(0, -1).contiguous().transpose(0, -1) if t.dim() > 1 else t,
}


def _operator_case(form, dtype, layout, seed=0):
    shape, data_format, stats_shape = FORMS[form]
    g = torch.Generator().manual_seed(seed)
    x = LAYOUTS[layout]((torch.randn(shape, generator=g) * 3 + 2).to(dtype))
    dy = LAYOUTS[layout](torch.randn(shape, generator=g).to(dtype))
    param = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
    gamma = (torch.rand(stats_shape(shape), generator=g) + 0.5).to(param)
    beta = torch.randn(stats_shape(shape), generator=g).to(param)
    mean = torch.randn(stats_shape(shape), generator=g).to(param)
    var = (torch.rand(stats_shape(shape), generator=g) + 0.5).to(param)
    return x, dy, gamma, beta, mean, var, data_format


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16],
                         ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("form", FORMS)
def test_lowered_operators_match_eager(form, dtype, layout):
    """Every form of the contract: batch and frozen statistics, both backward
    modes and a partial output mask, compiled against the eager operators.
    Layouts a rewrite would not keep (here "strided") stay extern calls."""
    x, dy, gamma, beta, mean, var, data_format = _operator_case(form, dtype, layout)
    if x.dim() == 1 and form != "broadcast-rank1":
        pytest.skip("rank 1 takes the broadcast form only")

    def fn(x, dy, gamma, beta, mean, var):
        out = []
        dst, m, v = torch_bn_grad.batch_norm_forward(x, gamma, beta, epsilon=1e-3, data_format=data_format)
        out += [dst, m, v]
        out += torch_bn_grad.batch_norm_backward(x, dy, m, v, gamma, epsilon=1e-3, data_format=data_format)
        out += torch_bn_grad.batch_norm_forward(x, gamma, beta, mean, var, epsilon=1e-3, data_format=data_format)
        out += torch_bn_grad.batch_norm_backward(x, dy, mean, var, None, epsilon=1e-3, data_format=data_format,
                                                 training=False)
        out += [t for t in torch_bn_grad.batch_norm_backward(
            x, dy, m, v, gamma, epsilon=1e-3, data_format=data_format, output_mask=(True, False, True))
            if t is not None]
        return out

    compiled = torch.compile(fn, fullgraph=True)
    args = (x, dy, gamma, beta, mean, var)
    got, code = run_and_get_code(compiled, *args)
    expected = fn(*args)
    if form == "broadcast-rank1" or layout != "strided" or x.is_contiguous():
        assert _extern_calls(code, FORWARD_OPS) == 0
        # The two training backwards stay this library's kernels on CPU; the frozen one is rewritten.
        assert _extern_calls(code, BACKWARD_OPS) == 2
    else:
        assert _extern_calls(code, FORWARD_OPS) > 0  # kept opaque
    tol = TOL[dtype]
    for i, (a, b) in enumerate(zip(got, expected)):
        assert a.dtype == b.dtype and a.shape == b.shape, i
        if a.dim() >= 2 and a.numel() > 1:
            assert a.stride() == b.stride(), (i, a.stride(), b.stride())
        torch.testing.assert_close(a, b, **tol, msg=lambda m: f"output {i}: {m}")
    assert not counters["graph_break"]


@pytest.mark.parametrize("fuse", [False, True], ids=["ours", "fused"])
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_lowered_backward_receives_its_tensors_in_one_layout(layout, fuse):
    """The gradient reaching a batch norm from a max-pool's backward (a kernel of inductor's
    own, laid out as inductor likes) and a fused block's saved output come to this library's
    backward operator in src's layout: it copies nothing (it would copy them into src's)."""
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    memory_format = torch.channels_last if layout == "channels_last" else torch.contiguous_format
    native = torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 3, padding=1, bias=False), torch.nn.BatchNorm2d(16), torch.nn.ReLU(),
        torch.nn.MaxPool2d(3, 2, 1), torch.nn.Conv2d(16, 16, 3, padding=1, bias=False), torch.nn.BatchNorm2d(16),
        torch.nn.ReLU(), torch.nn.Conv2d(16, 16, 3, padding=1, bias=False), torch.nn.BatchNorm2d(16),
        torch.nn.ReLU(),
    ).to(memory_format=memory_format)
    model = torch_bn_grad.convert_batchnorm(native, fuse=fuse)
    compiled = torch.compile(model)
    x = torch.randn(4, 3, 32, 32).contiguous(memory_format=memory_format).requires_grad_()
    for _ in range(2):
        compiled(x).sum().backward()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        compiled(x).sum().backward()
    ops = [e for e in prof.events() if e.name.startswith("torch_bn_grad::batch_norm")]
    assert any("backward" in e.name for e in ops)

    def copies(event):
        for child in event.cpu_children:
            if child.name in ("aten::clone", "aten::contiguous", "aten::copy_"):
                yield child.name
            yield from copies(child)

    assert [(e.name, c) for e in ops for c in copies(e)] == []
