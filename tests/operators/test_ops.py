"""Numerics of the operators against the float64 reference, for every dtype,
data format, rank and memory layout, on every device; opcheck; the per-ISA
CPU kernels."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys

import pytest
import torch

import torch_bn_grad
from support.isa_runs import runs_to_compare
from support.reference import assert_close, cases, reference_backward, reference_forward

CASES = list(cases())
IDS = [str(c) for c in CASES]


@pytest.mark.parametrize("case", CASES, ids=IDS)
@pytest.mark.parametrize("frozen", [False, True], ids=["batch", "frozen"])
def test_forward_matches_reference(case, frozen, device):
    g = torch.Generator().manual_seed(0)
    x = case.make(g, scale=2.0, offset=0.5, device=device)
    gamma, beta, mean, var = case.params(g, device)
    args = (mean, var) if frozen else (None, None)
    dst, m, v = torch_bn_grad.batch_norm_forward(x, gamma, beta, *args, data_format=case.data_format)
    ref, ref_m, ref_v = reference_forward(x, gamma, beta, *args, 1e-5, case.data_format)
    assert dst.dtype == x.dtype and dst.shape == x.shape
    assert m.dtype == v.dtype == gamma.dtype and m.shape == v.shape == (case.channels,)
    if case.layout == "channels_last":
        fmt = torch.channels_last if x.dim() == 4 else torch.channels_last_3d
        assert dst.is_contiguous(memory_format=fmt)
    if case.layout == "transposed":
        assert dst.stride() == x.stride()
    assert_close(dst, ref, case.dtype)
    assert_close(m, ref_m, torch.float32 if case.dtype != torch.float64 else case.dtype)
    assert_close(v, ref_v, torch.float32 if case.dtype != torch.float64 else case.dtype, scale=4)


@pytest.mark.parametrize("case", CASES, ids=IDS)
@pytest.mark.parametrize("training", [True, False], ids=["training", "frozen"])
@pytest.mark.parametrize("with_gamma", [True, False], ids=["gamma", "nogamma"])
def test_backward_matches_reference(case, training, with_gamma, device):
    g = torch.Generator().manual_seed(1)
    x = case.make(g, scale=2.0, offset=0.5, device=device)
    dy = case.make(g, device=device)
    gamma, _, mean, var = case.params(g, device)
    if training:
        _, mean, var = reference_forward(x, None, None, None, None, 1e-5, case.data_format)
        mean, var = mean.to(gamma.dtype), var.to(gamma.dtype)
    gamma = gamma if with_gamma else None
    dx, dg, db = torch_bn_grad.batch_norm_backward(
        x, dy, mean, var, gamma, data_format=case.data_format, training=training
    )
    ref_dx, ref_dg, ref_db = reference_backward(x, dy, mean, var, gamma, 1e-5, case.data_format, training)
    assert dx.dtype == x.dtype and dg.dtype == db.dtype == mean.dtype
    assert dx.stride() == torch.empty_like(x).stride()
    m = x.numel() // case.channels
    assert_close(dx, ref_dx, case.dtype, scale=2)
    # Parameter gradients are sums of M terms.
    assert_close(dg, ref_dg, case.dtype, scale=m)
    assert_close(db, ref_db, case.dtype, scale=m)


STATS_FORMS = {"1d": [3], "broadcast": [1, 3, 1]}


@pytest.mark.parametrize("training", [True, False], ids=["training", "frozen"])
@pytest.mark.parametrize("form", list(STATS_FORMS))
def test_output_mask_returns_none(form, training, device):
    g = torch.Generator().manual_seed(7)
    x, dy = torch.randn(4, 3, 5, generator=g).to(device), torch.randn(4, 3, 5, generator=g).to(device)
    gamma = (torch.rand(STATS_FORMS[form], generator=g) + 0.5).to(device)
    _, mean, var = torch_bn_grad.batch_norm_forward(x, gamma, None)
    full = torch_bn_grad.batch_norm_backward(x, dy, mean, var, gamma, training=training)
    for mask in itertools.product((True, False), repeat=3):
        out = torch_bn_grad.batch_norm_backward(x, dy, mean, var, gamma, training=training, output_mask=mask)
        for o, f, wanted in zip(out, full, mask):
            if wanted:
                torch.testing.assert_close(o, f, atol=0, rtol=0)
            else:
                assert o is None


# (src shape, statistics shape, data_format, memory format): M == 0 in each form.
EMPTY_BATCHES = {
    "NCX": ((0, 3, 4), [3], "NCX", torch.contiguous_format),
    "NXC": ((0, 4, 3), [3], "NXC", torch.contiguous_format),
    "broadcast": ((0, 3, 4), [1, 3, 1], "NCX", torch.contiguous_format),
    "channels_last": ((0, 3, 4, 5), [3], "NCX", torch.channels_last),
    "rank1": ((0,), [1], "NCX", torch.contiguous_format),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("form", list(EMPTY_BATCHES))
def test_empty_batch(form, dtype, device):
    shape, sshape, fmt, memory_format = EMPTY_BATCHES[form]
    x = torch.empty(shape, dtype=dtype, device=device).to(memory_format=memory_format)
    gamma = torch.ones(sshape, device=device)
    dst, mean, var = torch_bn_grad.batch_norm_forward(x, gamma, None, data_format=fmt)
    assert dst.shape == x.shape and dst.is_contiguous(memory_format=memory_format)
    assert list(mean.shape) == sshape and mean.dtype == torch.float32
    assert mean.isnan().all() and var.isnan().all()
    zeros = torch.zeros(sshape, device=device)
    given = zeros, torch.ones(sshape, device=device)
    _, m, v = torch_bn_grad.batch_norm_forward(x, gamma, None, *given, data_format=fmt)
    assert torch.equal(m, given[0]) and torch.equal(v, given[1])
    for training in (True, False):
        dx, dg, db = torch_bn_grad.batch_norm_backward(x, x, *given, gamma, data_format=fmt, training=training)
        assert dx.shape == x.shape and dx.dtype == dtype and dx.is_contiguous(memory_format=memory_format)
        assert torch.equal(dg, zeros) and torch.equal(db, zeros)
    _, dg, db = torch_bn_grad.batch_norm_backward(x, x, *given, data_format=fmt, output_mask=(False, True, False))
    assert torch.equal(dg, zeros) and db is None


def test_no_channels(device):
    x = torch.randn(2, 0, 3, device=device)
    dst, mean, var = torch_bn_grad.batch_norm_forward(x)
    assert dst.shape == x.shape and mean.shape == var.shape == (0,)
    dx, dg, db = torch_bn_grad.batch_norm_backward(x, x, mean, var)
    assert dx.shape == x.shape and dg.shape == db.shape == (0,)


def test_inputs_are_not_modified(device):
    g = torch.Generator().manual_seed(2)
    x, dy = torch.randn(4, 3, 5, generator=g), torch.randn(4, 3, 5, generator=g)
    mean, var, gamma = torch.randn(3, generator=g), torch.rand(3, generator=g) + 1, torch.randn(3, generator=g)
    x, dy, mean, var, gamma = (t.to(device) for t in (x, dy, mean, var, gamma))
    before = [t.clone() for t in (x, dy, mean, var, gamma)]
    torch_bn_grad.batch_norm_backward(x, dy, mean, var, gamma)
    torch_bn_grad.batch_norm_forward(x, gamma, gamma, mean, var)
    torch_bn_grad.batch_norm_forward(x, gamma, gamma)
    for t, b in zip((x, dy, mean, var, gamma), before):
        assert torch.equal(t, b)


def test_half_data_with_same_dtype_parameters(device):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(8, 4, 6, generator=g).to(device, torch.bfloat16)
    gamma = torch.rand(4, generator=g).to(device, torch.bfloat16) + 0.5
    dst, mean, var = torch_bn_grad.batch_norm_forward(x, gamma, None, gamma * 0, gamma)
    assert mean.dtype == torch.bfloat16
    ref, _, _ = reference_forward(x, gamma, None, gamma * 0, gamma, 1e-5, "NCX")
    assert_close(dst, ref, torch.bfloat16)


def _determinism_inputs(family: str, dtype: torch.dtype, device: str):
    """Inputs that span many reduction blocks in each kernel family: per-channel
    planes (NCHW), rows with channels innermost (channels_last), and rows with
    more channels than one block takes (NXC, 1300 channels)."""
    g = torch.Generator().manual_seed(4)
    if family == "rows-wide":
        shape, fmt = (600, 1300), "NXC"
    else:
        shape, fmt = (16, 8, 40, 40), "NCX"
    x = (torch.randn(shape, generator=g) * 3 + 100).to(device, dtype)
    dy = torch.randn(shape, generator=g).to(device, dtype)
    if family == "rows":
        x, dy = x.contiguous(memory_format=torch.channels_last), dy.contiguous(memory_format=torch.channels_last)
    return x, dy, fmt


@pytest.mark.parametrize("family", ["planes", "rows", "rows-wide"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16], ids=lambda d: str(d)[6:])
def test_results_are_bitwise_identical_across_runs_and_thread_counts(dtype, family, device):
    """Run to run on every device; on the CPU also across 1 and 2 threads (the
    CUDA kernels' partition depends on the shape only, not on a thread count)."""
    x, dy, fmt = _determinism_inputs(family, dtype, device)

    def run():
        dst, mean, var = torch_bn_grad.batch_norm_forward(x, data_format=fmt)
        grads = torch_bn_grad.batch_norm_backward(x, dy, mean, var, data_format=fmt)
        return (dst, mean, var, *grads)

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        results = [run(), run()]
        if device == "cpu":
            torch.set_num_threads(1)
            results.append(run())
    finally:
        torch.set_num_threads(threads)
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.equal(a, b)


OPCHECK_CASES = [
    (dtype, layout, rg)
    for dtype in (torch.float32, torch.bfloat16)
    for layout in ("contiguous", "channels_last")
    for rg in (False, True)
]


def _opcheck_inputs(dtype, layout, requires_grad, device):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(4, 3, 5, 6, generator=g).to(device, dtype)
    dy = torch.randn(4, 3, 5, 6, generator=g).to(device, dtype)
    if layout == "channels_last":
        x, dy = x.to(memory_format=torch.channels_last), dy.to(memory_format=torch.channels_last)
    gamma, beta = (torch.rand(3, generator=g) + 0.5).to(device), torch.randn(3, generator=g).to(device)
    mean, var = x.float().mean((0, 2, 3)), x.float().var((0, 2, 3), unbiased=False)
    if requires_grad:
        for t in (x, dy, gamma, beta):
            t.requires_grad_()
    return x, dy, gamma, beta, mean, var


@pytest.mark.parametrize("dtype,layout,requires_grad", OPCHECK_CASES)
def test_opcheck_forward(dtype, layout, requires_grad, device):
    x, _, gamma, beta, mean, var = _opcheck_inputs(dtype, layout, requires_grad, device)
    op = torch.ops.torch_bn_grad.batch_norm_forward.default
    torch.library.opcheck(op, (x, gamma, beta, None, None, 1e-5, "NCX"))
    torch.library.opcheck(op, (x, gamma, beta, mean, var, 1e-5, "NCX"))


@pytest.mark.parametrize("dtype,layout,requires_grad", OPCHECK_CASES)
def test_opcheck_backward(dtype, layout, requires_grad, device):
    x, dy, gamma, _, mean, var = _opcheck_inputs(dtype, layout, requires_grad, device)
    op = torch.ops.torch_bn_grad.batch_norm_backward.default
    torch.library.opcheck(op, (x, dy, mean, var, gamma, 1e-5, "NCX", True, [True, True, True]))
    torch.library.opcheck(op, (x, dy, mean, var, None, 1e-5, "NCX", False, [True, False, True]))


_ISA_SCRIPT = r"""
import json, torch, torch_bn_grad
g = torch.Generator().manual_seed(6)
out = {"isa": torch_bn_grad.cpu_kernel_isa(), "results": []}
for dtype in (torch.float32, torch.bfloat16, torch.float64):
    for shape, fmt in (((4, 5, 33), "NCX"), ((37, 70), "NXC"), ((3, 300, 3), "NXC")):
        x = torch.randn(shape, generator=g).to(dtype) * 2 + 3
        dy = torch.randn(shape, generator=g).to(dtype)
        dst, mean, var = torch_bn_grad.batch_norm_forward(x, data_format=fmt)
        dx, dg, db = torch_bn_grad.batch_norm_backward(x, dy, mean, var, data_format=fmt)
        out["results"].append([t.double().flatten().tolist() for t in (dst, mean, var, dx, dg, db)])
print(json.dumps(out))
"""


def test_every_isa_kernel_agrees():
    """Each compiled ISA copy runs when selected and gives the same results."""
    runs = runs_to_compare(_ISA_SCRIPT)
    base = next(iter(runs.values()))["results"]
    for c, run in runs.items():
        for case_a, case_b in zip(base, run["results"]):
            for a, b in zip(case_a, case_b):
                torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=2e-2, rtol=1e-2)


def _expected_copy(asked: str, compiled: list[str]) -> str:
    """kernel_table.cpp's rule: the highest compiled copy at or below the
    capability asked, else the lowest above it (this CPU built them all)."""
    order = ["DEFAULT", "AVX2", "AVX512"]
    below = [isa for isa in compiled if order.index(isa) <= order.index(asked)]
    return below[-1] if below else compiled[0]


@pytest.mark.parametrize("asked", ["default", "avx2", "avx512"])
def test_isa_copy_follows_the_capability(asked):
    """ATEN_CPU_CAPABILITY picks the copy it names where it was compiled, the
    nearest one below it else, and a copy above it (with a warning) where
    none is below: a build for the building CPU alone has no DEFAULT copy."""
    order = ["default", "avx2", "avx512"]
    supported = torch.backends.cpu.get_cpu_capability().lower()
    if supported not in order or order.index(asked) > order.index(supported):
        pytest.skip(f"this CPU does not run {asked}")
    compiled = list(torch_bn_grad.compiled_cpu_kernel_isas())
    runnable = [isa for isa in compiled if order.index(isa.lower()) <= order.index(supported)]
    # The choice is made once, at the first kernel call; its warning goes to stderr.
    code = ("import torch, torch_bn_grad\n"
            "torch_bn_grad.batch_norm_forward(torch.randn(4, 3, 5), None, None)\n"
            "print(torch_bn_grad.cpu_kernel_isa())")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=dict(os.environ, ATEN_CPU_CAPABILITY=asked))
    assert proc.returncode == 0, proc.stderr
    expected = _expected_copy(asked.upper(), runnable)
    assert proc.stdout.split() == [expected]
    warned = f"kernels were not compiled for {asked.upper()}" in proc.stderr
    assert warned == (order.index(expected.lower()) > order.index(asked)), proc.stderr


def test_import_before_torch_in_a_fresh_process():
    """`import torch_bn_grad` works as a program's first import."""
    code = "import torch_bn_grad, torch; print(torch_bn_grad.cpu_kernel_isa())"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
