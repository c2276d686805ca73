"""The CPU output cache (torch_bn_grad.memory): large outputs reuse freed
blocks of the same size, within a limit, and stay ordinary tensors."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest
import torch

import torch_bn_grad
from torch_bn_grad import memory
from support.reference import assert_close

LARGE = (8, 16, 48, 48)  # 1.18 MB of float32: cached
SMALL = (4, 8, 16, 16)  # 32 KB: plain allocation


@pytest.fixture(autouse=True)
def fresh_cache():
    limit = memory.output_cache_info()["limit_bytes"]
    memory.empty_output_cache()
    yield
    memory.set_output_cache_limit(limit)
    memory.empty_output_cache()


def forward(x: torch.Tensor) -> torch.Tensor:
    return torch_bn_grad.batch_norm_forward(x, torch.ones(x.shape[1]), torch.zeros(x.shape[1]))[0]


def test_a_freed_output_is_reused_for_the_next_output_of_its_size():
    x = torch.randn(LARGE)
    before = memory.output_cache_info()
    y = forward(x)
    ptr = y.data_ptr()
    del y
    info = memory.output_cache_info()
    assert info["misses"] == before["misses"] + 1
    assert info["idle_blocks"] == 1 and info["idle_bytes"] >= x.nbytes
    y = forward(x)
    assert y.data_ptr() == ptr
    assert memory.output_cache_info()["hits"] == before["hits"] + 1
    assert memory.output_cache_info()["idle_blocks"] == 0


def test_reused_memory_gives_the_same_results_in_every_operator():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(LARGE, generator=g)
    dy = torch.randn(LARGE, generator=g)
    w = torch.rand(LARGE[1], generator=g) + 0.5
    first = torch_bn_grad.batch_norm_forward(x, w, None)
    first_grad = torch_bn_grad.batch_norm_backward(x, dy, first[1], first[2], w)
    # Fill idle blocks with garbage-bearing outputs, free them, run again.
    junk = [forward(torch.full(LARGE, 7.0)) for _ in range(2)]
    del junk
    again = torch_bn_grad.batch_norm_forward(x, w, None)
    again_grad = torch_bn_grad.batch_norm_backward(x, dy, again[1], again[2], w)
    assert memory.output_cache_info()["hits"] >= 2
    for a, b in zip(first + first_grad, again + again_grad):
        assert torch.equal(a, b)


@pytest.mark.parametrize("layout", ["contiguous", "channels_last", "sliced", "transposed"])
def test_cached_outputs_have_the_strides_of_empty_like(layout):
    x = torch.randn(8, 16, 48, 96)
    x = {
        "contiguous": x,
        "channels_last": x.contiguous(memory_format=torch.channels_last),
        "sliced": x[:, :, :, ::2],
        "transposed": x.transpose(2, 3),
    }[layout]
    y = forward(x)
    assert y.stride() == torch.empty_like(x).stride()
    ref = torch.nn.functional.batch_norm(x.double(), None, None, training=True)
    assert_close(y, ref, torch.float32)


def test_small_outputs_bypass_the_cache():
    before = memory.output_cache_info()
    y = forward(torch.randn(SMALL))
    del y
    after = memory.output_cache_info()
    assert (after["hits"], after["misses"], after["idle_blocks"]) == (before["hits"], before["misses"], 0)


def test_the_limit_bounds_idle_memory_and_zero_disables_the_cache():
    x = torch.randn(LARGE)
    memory.set_output_cache_limit(0)
    del_y = forward(x)
    del del_y
    assert memory.output_cache_info()["idle_bytes"] == 0
    memory.set_output_cache_limit(x.nbytes * 3 // 2)  # room for one block
    ys = [forward(x) for _ in range(3)]
    del ys
    info = memory.output_cache_info()
    assert info["idle_blocks"] == 1 and info["idle_bytes"] <= info["limit_bytes"]


def test_empty_output_cache_frees_idle_blocks_only():
    x = torch.randn(LARGE)
    kept, freed = forward(x), forward(x)
    expected = kept.clone()
    del freed
    assert memory.output_cache_info()["idle_blocks"] == 1
    memory.empty_output_cache()
    assert memory.output_cache_info()["idle_bytes"] == 0
    assert torch.equal(kept, expected)
    del kept
    assert memory.output_cache_info()["idle_blocks"] == 1


def test_outputs_may_be_freed_on_other_threads():
    x = torch.randn(LARGE)
    outputs = [forward(x) for _ in range(8)]

    def free(chunk):
        chunk.clear()

    threads = [threading.Thread(target=free, args=(outputs[i::2],)) for i in range(2)]
    del outputs
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    info = memory.output_cache_info()
    assert info["idle_blocks"] == 8 and info["idle_bytes"] <= info["limit_bytes"]


def test_negative_limit_is_a_value_error_naming_the_argument():
    with pytest.raises(ValueError, match="nbytes >= 0, got -1"):
        memory.set_output_cache_limit(-1)


def _run_with_env(value: str, code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, TORCH_BN_GRAD_OUTPUT_CACHE_MB=value)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


def test_environment_sets_the_limit():
    done = _run_with_env("0", "import torch_bn_grad as t; print(t.memory.output_cache_info()['limit_bytes'])")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "0"
    done = _run_with_env("64", "import torch_bn_grad as t; print(t.memory.output_cache_info()['limit_bytes'])")
    assert done.stdout.strip() == str(64 << 20)


def test_a_malformed_environment_value_is_a_clear_error():
    done = _run_with_env("lots", "import torch_bn_grad as t; t.memory.output_cache_info()")
    assert done.returncode == 1  # a Python exception, not an abort
    assert "ValueError: TORCH_BN_GRAD_OUTPUT_CACHE_MB: expected a non-negative integer (megabytes), got 'lots'" in (
        done.stderr)
