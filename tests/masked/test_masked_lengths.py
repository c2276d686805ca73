"""The ``lengths=`` form of masked batch norm on (N, C, L) input: bitwise the
``mask=`` form with ``mask = arange(L) < lengths[:, None]`` (outputs,
gradients, running statistics, ``num_batches_tracked``) in the modules, the
functional forms, TorchScript and SyncBatchNorm over ranks; its errors;
and under ``torch.compile(fullgraph=True)`` the mask is made from the
lengths tensor inside the graph, without a host read."""

from __future__ import annotations

import copy
import io
import operator
from typing import Optional

import pytest
import torch
from torch import Tensor

import torch_bn_grad
from support.masked_reference import lengths_mask
from support.spawned_ranks import WORLD_SIZE, run_on_ranks

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

N, C, L = 5, 6, 12
# A length below 0 counts as 0 and one above L as L, as the comparison gives them.
LENGTHS = [12, 4, 0, 7, 15]


def _data(seed: int = 0, dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, C, L, generator=g).to(dtype)
    residual = torch.randn(N, C, L, generator=g).to(dtype)
    dy = torch.randn(N, C, L, generator=g).to(dtype)
    lengths = torch.tensor(LENGTHS)
    return x, residual, dy, lengths


def _mask(lengths: Tensor) -> Tensor:
    return lengths_mask(lengths.clamp(0, L).tolist(), L)


def _randomized(module: torch.nn.Module) -> torch.nn.Module:
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        module.weight.copy_(torch.rand(C, generator=g) + 0.5)
        module.bias.copy_(torch.randn(C, generator=g))
        module.running_mean.copy_(torch.randn(C, generator=g))
        module.running_var.copy_(torch.rand(C, generator=g) + 0.5)
    return module


def _step(module: torch.nn.Module, x: Tensor, dy: Tensor, residual: Optional[Tensor], **kwargs) -> dict:
    x = x.clone().requires_grad_()
    args = (x,) if residual is None else (x, residual)
    out = module(*args, **kwargs)
    out.backward(dy)
    found = {"out": out.detach(), "grad": x.grad}
    found.update({f"grad.{n}": p.grad for n, p in module.named_parameters()})
    found.update(module.state_dict())
    return found


def _assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


MODULES = {
    "BatchNorm1d": lambda: torch_bn_grad.nn.BatchNorm1d(C),
    "SyncBatchNorm": lambda: torch_bn_grad.nn.SyncBatchNorm(C),
    "BatchNormAct1d": lambda: torch_bn_grad.nn.BatchNormAct1d(C, activation="leaky_relu", negative_slope=0.2),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lengths_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("train", [True, False])
@pytest.mark.parametrize("name", list(MODULES))
def test_module_lengths_equal_the_mask_bitwise(name, train, lengths_dtype, dtype):
    x, residual, dy, lengths = _data(dtype=dtype)
    residual = residual if name == "BatchNormAct1d" else None
    ours = _randomized(MODULES[name]()).to(dtype).train(train)
    theirs = copy.deepcopy(ours)
    lengths = lengths.to(lengths_dtype)
    for _ in range(2):  # the second step normalizes with the first's running statistics in eval
        _assert_same(_step(ours, x, dy, residual, lengths=lengths), _step(theirs, x, dy, residual, mask=_mask(lengths)))
    assert torch.equal(lengths, torch.tensor(LENGTHS, dtype=lengths_dtype))  # not modified


@pytest.mark.parametrize("act", [False, True])
def test_functional_lengths_equal_the_mask_bitwise(act):
    x, residual, _, lengths = _data()
    rm, rv = torch.randn(C), torch.rand(C) + 0.5
    weight, bias = torch.rand(C) + 0.5, torch.randn(C)
    results = []
    for kwargs in ({"lengths": lengths}, {"mask": _mask(lengths)}):
        stats = (rm.clone(), rv.clone())
        if act:
            out = torch_bn_grad.functional.batch_norm_act(x, *stats, weight, bias, True, residual=residual,
                                                          activation="silu", **kwargs)
        else:
            out = torch_bn_grad.functional.batch_norm(x, *stats, weight, bias, True, **kwargs)
        results.append((out, *stats))
    for got, want in zip(*results):
        assert torch.equal(got, want)


@pytest.mark.parametrize("make", [lambda: torch_bn_grad.nn.BatchNorm1d(C), lambda: torch_bn_grad.nn.BatchNormAct1d(C)])
def test_torchscript_lengths_equal_the_eager_mask_form(make):
    x, residual, dy, lengths = _data()
    residual = residual if isinstance(make(), torch_bn_grad.nn.BatchNormAct1d) else None
    eager = _randomized(make()).train()
    buffer = io.BytesIO()
    torch.jit.save(torch.jit.script(copy.deepcopy(eager)), buffer)
    buffer.seek(0)
    scripted = torch.jit.load(buffer)
    for _ in range(2):
        want = _step(eager, x, dy, residual, mask=_mask(lengths))
        got = _step(scripted, x, dy, residual, lengths=lengths)
        _assert_same(got, want)
    with pytest.raises(Exception, match="lengths must be an integer tensor"):
        scripted(x, lengths=lengths.float())
    with pytest.raises(Exception, match="mask or lengths, not both"):
        scripted(x, mask=_mask(lengths), lengths=lengths)


BAD = {
    "float dtype": (lambda x, n: {"lengths": n.float()}, TypeError, "lengths must be an integer tensor.*float32"),
    "bool dtype": (lambda x, n: {"lengths": n > 3}, TypeError, "lengths must be an integer tensor.*bool"),
    "a list": (lambda x, n: {"lengths": LENGTHS}, TypeError, "lengths must be an integer tensor.*list"),
    "too short": (lambda x, n: {"lengths": n[:3]}, ValueError, r"lengths must have shape \[5\].*got \[3\]"),
    "rank 2": (lambda x, n: {"lengths": n[:, None]}, ValueError, r"lengths must have shape \[5\].*got \[5, 1\]"),
    "scalar": (lambda x, n: {"lengths": n[0]}, ValueError, r"lengths must have shape \[5\].*got \[\]"),
    "another device": (lambda x, n: {"lengths": n.to("meta")}, ValueError, "lengths must be on input's device"),
    "with a mask": (lambda x, n: {"lengths": n, "mask": _mask(n)}, ValueError, "give mask or lengths, not both"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_lengths_raise_before_anything_is_written(case):
    x, _, _, lengths = _data()
    make_kwargs, error, message = BAD[case]
    module = _randomized(torch_bn_grad.nn.BatchNorm1d(C)).train()
    before = copy.deepcopy(module.state_dict())
    x_before = x.clone()
    with pytest.raises(error, match="BatchNorm1d: " + message):
        module(x, **make_kwargs(x, lengths))
    _assert_same(module.state_dict(), before)
    assert torch.equal(x, x_before)
    with pytest.raises(error, match="batch_norm: " + message):
        torch_bn_grad.functional.batch_norm(x, None, None, training=True, **make_kwargs(x, lengths))
    with pytest.raises(error, match="batch_norm_act: " + message):
        torch_bn_grad.functional.batch_norm_act(x, None, None, training=True, **make_kwargs(x, lengths))


@pytest.mark.parametrize("shape", [(N, C), (N, C, L, 3)])
def test_lengths_needs_three_dimensional_input(shape):
    module = torch_bn_grad.nn.BatchNorm1d(C) if len(shape) == 2 else torch_bn_grad.nn.BatchNorm2d(C)
    with pytest.raises(ValueError, match=r"lengths takes an input of rank 3 \(N, C, L\), got shape"):
        module(torch.randn(shape), lengths=torch.tensor(LENGTHS))
    assert module.num_batches_tracked.item() == 0


def test_compiled_fullgraph_makes_the_mask_in_the_graph():
    """One graph (fullgraph=True fails on a graph break) in which the lengths input
    is compared with an arange, and no host read of it (dynamo records a
    ``.tolist()`` or ``.item()`` as ``item`` calls, whose values a CUDA step
    would wait for)."""
    x, residual, dy, lengths = _data()
    graphs = []

    def capture(gm: torch.fx.GraphModule, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    eager = _randomized(torch_bn_grad.nn.BatchNormAct1d(C)).train()
    compiled_module = copy.deepcopy(eager)
    compiled = torch.compile(lambda a, r, n: compiled_module(a, r, lengths=n), backend=capture, fullgraph=True)
    for step in range(2):
        n = lengths.roll(step)  # other values, the same graph: they are data, not constants
        want = _step(eager, x, dy, residual, mask=_mask(n))
        a = x.clone().requires_grad_()
        out = compiled(a, residual, n)
        out.backward(dy)
        got = {"out": out.detach(), "grad": a.grad}
        got.update({f"grad.{k}": p.grad for k, p in compiled_module.named_parameters()})
        got.update(compiled_module.state_dict())
        _assert_same(got, want)
    assert len(graphs) == 1
    nodes = list(graphs[0].graph.nodes)
    lengths_input = next(node for node in nodes if node.op == "placeholder" and node.target == "L_n_")
    compare = [node for node in nodes if node.target is operator.lt]
    assert len(compare) == 1, [node.target for node in nodes]
    arange, indexed = compare[0].args
    assert arange.target is torch.arange and indexed.args[0] is lengths_input
    assert not any(node.target in ("item", "tolist", torch.ops.aten._local_scalar_dense.default) for node in nodes)

def _sync_ranks(rank: int) -> dict:
    """A SyncBatchNorm step on this rank's part, with lengths and with the mask."""
    per_rank = [[12, 5, 9], [0, 0]]  # different valid counts, one rank of padding only
    lengths = torch.tensor(per_rank[rank])
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(len(lengths), C, L, generator=g, dtype=torch.float64)
    dy = torch.randn(x.shape, generator=g, dtype=torch.float64)
    results = {}
    for form in ("lengths", "mask"):
        module = torch_bn_grad.nn.SyncBatchNorm(C).double()
        kwargs = {"lengths": lengths} if form == "lengths" else {"mask": _mask(lengths)}
        results[form] = _step(module, x, dy, None, **kwargs)
    return results


def test_sync_batch_norm_over_ranks_lengths_equal_the_mask(tmp_path):
    assert WORLD_SIZE == 2
    for found in run_on_ranks(_sync_ranks, (), tmp_path, 180, backend="gloo"):
        _assert_same(found["lengths"], found["mask"])
