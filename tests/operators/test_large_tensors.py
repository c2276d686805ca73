"""Large tensors (4 MB to 100 MB), whose CPU kernels take other paths than small
ones: every such path gives float64's results to the dtype's rounding, on every
compiled ISA copy.

Large outputs, which the CPU kernels write with streaming stores.

An elementwise pass that moves 48 MB or more (its inputs and output) writes
its output with non-temporal stores where lines (plane rows, or rows of
channels) start on a cache line (``streams_output`` in
``csrc/cpu/kernels/partition.h``), one intrinsic per ISA; rows of 16
channels, walked as one flat run (``tiled_rows``), where the run does. The outputs here
are 24 MB or more, so that the forward's and eval's passes (x and out)
stream as well as the backward's (x, dy and dx). Each ISA copy runs in
its own process (``ATEN_CPU_CAPABILITY``) and is checked against float64
autograd of ``torch.nn.functional.batch_norm``: forward (batch and frozen
statistics), and backward, for NCHW planes, channels_last rows and
BatchNorm1d rows, float32 and bfloat16: a wrong, misplaced or dropped
streaming store shows as errors far above the tolerances (a store off by a
factor of 1 + 1e-4 fails).

The statistics' first pass walked row by row (``stats_walk_rows`` in
``csrc/cpu/kernels/row_statistics.h``): half-precision rows of channels
(channels_last, 2-D inputs) of 512 bytes or more in tensors of 12 MB or more
are read one whole row after another, the run's sums in L1, instead of a line
of each of 8 rows at a time; the sums meet in the same order. Each case takes
that path: plain and fused, a channel count with columns past the last full
chunk (520 = 16 chunks of 32 + 8), and a residual with the sign bits' gate.

The forward and the backward in channel runs.

Where planes are short (under 1 KiB, or under 4 KiB on a 4 MB tensor), are
reduced as planes, and a pass's operands are at least
``channel_runs_min_pass_bytes`` (``csrc/cpu/cache_geometry.cpp``: 8 MB under
a server's mesh L3, an Intel core's with AVX512 or, on other vendors', one
over 64 MB; where the L3 is an AMD CCD's (whatever its size) or a client
chip's, its size for the backward and never for the forward; the size as
Linux describes CPU 0's L3, else the C library's; or
``TORCH_BN_GRAD_CHANNEL_RUNS_MB`` for both), each thread reduces a run of adjacent channels, finishes them and
runs their elementwise pass while they are still in its L2
(``channel_run_channels`` in ``csrc/cpu/kernels/partition.h``).

The accuracy cases run with the threshold at 8 MB, whatever the CPU's
caches, so that each takes the path it names, forward and backward (the
fused forward writes its sign bits a run row at a time): every case below
takes the runs but the last, whose odd channel count keeps 14x14 planes in the whole-array
pass: a last run shorter than the others, runs of 7x7 planes of eight channels
each (where the fused forward's sign bits start on a byte), 28x28
half-precision planes, and the fused operators' gates (sign bits, the output
in the memory-saving mode, the recomputed input of silu, with a residual).
The two orders must give the same bits, and the threshold is read from the
environment with a clear error.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from support.grad_cases import check_cases
from support.isa_runs import run_on_every_isa


# ------------------------------------------------------------------ outputs written with streaming stores
_SCRIPT = r"""
import json, torch, torch.nn.functional as F, torch_bn_grad
g = torch.Generator().manual_seed(11)
cases = [((32, 64, 56, 56), torch.float32, False), ((32, 64, 56, 56), torch.float32, True),
         ((6272, 1024), torch.float32, False), ((32, 64, 80, 80), torch.bfloat16, False),
         ((32, 64, 80, 80), torch.bfloat16, True), ((64, 16, 112, 112), torch.bfloat16, True)]
errors = []
for shape, dtype, channels_last in cases:
    assert 2 * torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size() >= 48 << 20
    x = (torch.randn(shape, generator=g) * 2 + 1).to(dtype)
    dy = torch.randn(shape, generator=g).to(dtype)
    if channels_last:
        x, dy = x.contiguous(memory_format=torch.channels_last), dy.contiguous(memory_format=torch.channels_last)
    C = shape[1]
    gamma, beta = torch.rand(C, generator=g) + 0.5, torch.randn(C, generator=g)
    dst, mean, var = torch_bn_grad.batch_norm_forward(x, gamma, beta, epsilon=1e-5)
    frozen, _, _ = torch_bn_grad.batch_norm_forward(x, gamma, beta, mean, var, epsilon=1e-5)
    dx, dgamma, dbeta = torch_bn_grad.batch_norm_backward(x, dy, mean, var, gamma, epsilon=1e-5)
    xd = x.double().requires_grad_()
    gd, bd = gamma.double().requires_grad_(), beta.double().requires_grad_()
    ref = F.batch_norm(xd, None, None, gd, bd, training=True, eps=1e-5)
    ref_dx, ref_dg, ref_db = torch.autograd.grad(ref, (xd, gd, bd), dy.double())
    ref_frozen = F.batch_norm(x.double(), mean.double(), var.double(), gamma.double(), beta.double(),
                              training=False, eps=1e-5)
    def err(a, b):
        return ((a.double() - b) / (b.abs() + 1)).abs().max().item()
    errors.append({"case": f"{shape} {dtype} channels_last={channels_last}",
                   "dst_is_channels_last": dst.is_contiguous(memory_format=torch.channels_last) if channels_last else None,
                   "dst": err(dst, ref.detach()), "frozen": err(frozen, ref_frozen),
                   "dx": err(dx, ref_dx), "dgamma": err(dgamma, ref_dg), "dbeta": err(dbeta, ref_db)})
print(json.dumps({"isa": torch_bn_grad.cpu_kernel_isa(), "errors": errors}))
"""


def test_large_outputs_on_every_isa():
    for capability, run in run_on_every_isa(_SCRIPT).items():
        for case in run["errors"]:
            half = "bfloat16" in case["case"]
            # Relative to |reference| + 1: one rounding of the output (bfloat16's is 2^-8).
            bound = 2 ** -7 if half else 1e-5
            for name in ("dst", "frozen", "dx"):
                assert case[name] < bound, (capability, case)
            for name in ("dgamma", "dbeta"):
                assert case[name] < 1e-4, (capability, case)
            assert case["dst_is_channels_last"] in (None, True), (capability, case)


# ------------------------------------------------------------------ half-precision statistics walked row by row
_STATS_ROW_CASES = """[
    ((25600, 256), torch.float16, None, False, False),
    ((13000, 520), torch.bfloat16, None, False, False),          # 8 columns past the last full chunk
    ((25600, 256), torch.bfloat16, "relu", False, True),         # fused, with a residual
]
"""


def test_large_half_precision_channels_last_statistics():
    check_cases(_STATS_ROW_CASES)


# ------------------------------------------------------------------ short planes in cache-sized channel runs
_CHANNEL_RUN_CASES = """[
    ((16, 1024, 14, 14), torch.float32, None, False, False),     # backward runs of 14 channels: a thread's last of 8 or 2
    ((16, 1024, 14, 14), torch.float32, "relu", False, True),    # sign bits, 2 planes to a unit
    ((8, 8192, 7, 7), torch.float32, "relu", False, False),      # 7x7 planes of 8 rows: units of 8 planes
    ((16, 520, 28, 28), torch.bfloat16, "leaky_relu", False, False),
    ((8, 1040, 28, 28), torch.float32, "identity", True, True),  # memory saving: the output read back
    ((16, 1024, 14, 14), torch.float32, "silu", False, True),
    ((32, 513, 14, 14), torch.float32, "relu", False, False),    # odd channels: the whole-array pass
]
"""


def test_large_tensors_of_short_planes():
    check_cases(_CHANNEL_RUN_CASES, {"TORCH_BN_GRAD_CHANNEL_RUNS_MB": "8"})


# The backward of each case, plain and fused, as the bytes of its gradients.
_SAME_BITS_SCRIPT = r"""
import hashlib, json, torch, torch_bn_grad
g = torch.Generator().manual_seed(11)
digests = []
for shape, dtype, act in [((32, 256, 14, 14), torch.float32, None), ((16, 128, 28, 28), torch.float32, "relu"),
                          ((8, 512, 14, 14), torch.bfloat16, "leaky_relu"), ((32, 130, 14, 14), torch.float16, None)]:
    x = (torch.randn(shape, generator=g) * 3 + 1).to(dtype).requires_grad_()
    dy = torch.randn(shape, generator=g).to(dtype)
    gamma = (torch.rand(shape[1], generator=g) + 0.5).requires_grad_()
    beta = torch.randn(shape[1], generator=g).requires_grad_()
    if act is None:
        outs = torch_bn_grad.batch_norm_forward(x, gamma, beta, epsilon=1e-5)
    else:
        outs = torch_bn_grad.batch_norm_act_forward(x, gamma, beta, epsilon=1e-5, activation=act)
    grads = torch.autograd.grad(outs[0], (x, gamma, beta), dy)
    tensors = [t.detach().contiguous() for t in (*outs, *grads)]
    digests.append(hashlib.sha256(b"".join(t.view(torch.uint8).numpy().tobytes() for t in tensors)).hexdigest())
print(json.dumps({"isa": torch_bn_grad.cpu_kernel_isa(), "digests": digests,
                  "min_pass_bytes": torch_bn_grad._C.cpu_channel_runs_min_pass_bytes()}))
"""


def test_runs_and_the_whole_array_pass_give_the_same_bits():
    runs = run_on_every_isa(_SAME_BITS_SCRIPT, {"TORCH_BN_GRAD_CHANNEL_RUNS_MB": "0"})
    whole = run_on_every_isa(_SAME_BITS_SCRIPT, {"TORCH_BN_GRAD_CHANNEL_RUNS_MB": "100000"})
    for capability, run in runs.items():
        assert run["min_pass_bytes"] == {"forward": 0, "backward": 0}
        assert whole[capability]["min_pass_bytes"] == {"forward": 100000 << 20, "backward": 100000 << 20}
        assert run["digests"] == whole[capability]["digests"], capability


def _threshold_with_env(value: str) -> subprocess.CompletedProcess:
    code = "import json, torch_bn_grad as t; print(json.dumps(t._C.cpu_channel_runs_min_pass_bytes()))"
    env = dict(os.environ, TORCH_BN_GRAD_CHANNEL_RUNS_MB=value)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


def test_the_threshold_comes_from_the_environment_or_the_caches():
    done = _threshold_with_env("12")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"forward": 12 << 20, "backward": 12 << 20}
    done = _threshold_with_env("")  # unset: from the L3, at least 8 MB; the forward's None (never) or 8 MB
    assert done.returncode == 0, done.stderr
    sizes = json.loads(done.stdout)
    assert sizes["backward"] >= 8 << 20 and sizes["forward"] in (None, 8 << 20)


def test_a_malformed_threshold_is_a_clear_error():
    done = _threshold_with_env("big")
    assert done.returncode == 1  # a Python exception, not an abort
    assert "ValueError: TORCH_BN_GRAD_CHANNEL_RUNS_MB: expected a non-negative integer (megabytes), got 'big'" in (
        done.stderr)
