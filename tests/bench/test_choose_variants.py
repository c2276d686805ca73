"""scripts/choose_variants.py: a GPU run's variant timings and test results
become the choice per shape class and dtype (tests green, no case below the
floor, median at least the gain, the ResNet-50 step not slower); and
benchmarks/variants.py refuses to run without a GPU."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import torch_bn_grad

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import choose_variants  # noqa: E402


def _case(shape, dtype, layout, speedup):
    return {"shape": shape, "dtype": dtype, "layout": layout, "direction": "module", "default_ms": 1.0,
            "variant_ms": 1.0 / speedup, "speedup": speedup, "speedup_min": speedup, "speedup_max": speedup}


REPORT = {"device": "a GPU", "torch": "2.11.0", "commit": "abc", "date": "2026-12-02", "variants": {
    "fast": {"cases": [_case([8, 64, 8, 8], "float32", "contiguous", 1.2),
                       _case([4, 16, 8, 8], "float32", "contiguous", 1.1),
                       _case([32, 64, 56, 56], "float32", "contiguous", 1.0)],
             "model": {"speedup": 1.01}},
    "slow_step": {"cases": [_case([8, 64, 8, 8], "float32", "contiguous", 1.2)], "model": {"speedup": 0.95}},
    "red": {"cases": [_case([8, 64, 8, 8], "float32", "contiguous", 1.3)]},
}}

JUNIT = """<testsuites><testsuite>
<testcase classname="tests.cuda.test_cuda_variants" name="test_variant_is_bitwise_the_default[fast-2d]"/>
<testcase classname="tests.cuda.test_cuda_variants" name="test_variant_is_bitwise_the_default[slow_step-2d]"/>
<testcase classname="tests.cuda.test_cuda_variants" name="test_variant_is_bitwise_the_default[red-2d]">
<failure message="not equal"/></testcase>
</testsuite></testsuites>"""


@pytest.fixture
def files(tmp_path):
    results, junit = tmp_path / "variants.json", tmp_path / "gpu-tests.xml"
    results.write_text(json.dumps(REPORT))
    junit.write_text(JUNIT)
    return results, junit


def test_shape_classes_by_layout_and_size():
    assert choose_variants.shape_class(_case([8, 64, 8, 8], "float32", "contiguous", 1)) == "contiguous/small"
    assert choose_variants.shape_class(_case([32, 256, 56, 56], "float16", "channels_last", 1)) == \
        "channels_last/medium"
    assert choose_variants.shape_class(_case([64, 256, 56, 56], "float32", "contiguous", 1)) == "contiguous/large"


def test_choice_per_class(files):
    results, junit = files
    choice = choose_variants.choose(json.loads(results.read_text()), junit, 0.99, 1.01)["variants"]
    fast = choice["fast"]
    assert fast["tests_green"] and fast["tests_ran"] == 1
    assert fast["classes"]["contiguous/small/float32"]["chosen"]
    assert not fast["classes"]["contiguous/medium/float32"]["chosen"]  # 1.0x: no gain
    assert fast["verdict"] == "default in 1 of 2 classes"
    assert choice["slow_step"]["verdict"] == "delete (chosen nowhere)"  # the model step is slower
    assert not choice["red"]["tests_green"] and choice["red"]["verdict"] == "delete (chosen nowhere)"


def test_nothing_is_chosen_without_test_results(files, tmp_path):
    results, _ = files
    out = tmp_path / "choice.json"
    done = subprocess.run([sys.executable, str(ROOT / "scripts/choose_variants.py"), str(results), "--tests",
                           str(tmp_path / "missing.xml"), "--json", str(out)],
                          capture_output=True, text=True, check=True)
    assert "no test results" in done.stderr
    assert "fast: tests NOT green (0 ran)" in done.stdout
    assert not any(c["chosen"] for v in json.loads(out.read_text())["variants"].values() for c in v["classes"].values())


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is what a machine without a GPU sees")
def test_variant_bench_needs_a_gpu():
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks/variants.py")], capture_output=True, text=True,
                          cwd=ROOT)
    assert done.returncode != 0
    assert "no CUDA device is available" in done.stderr


def test_variant_bench_times_every_path_each_round():
    """benchmarks/variants.py's interleaving (run on the CPU, where the switch changes nothing): each
    round times the default and every variant, rotated, and each variant's speedup is taken over
    the default of the same round."""
    spec = importlib.util.spec_from_file_location("benchmark_variants", ROOT / "benchmarks" / "variants.py")
    variants = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(variants)

    names = ["fused_update", "param_dtype_grads"]
    firsts = [variants._order(names, r)[0][0] for r in range(3)]
    assert sorted(firsts) == ["default", *names]
    assert all(sorted(p for p, _ in variants._order(names, r)) == sorted(["default", *names]) for r in range(3))
    speed = variants._speedups({"default": [2.0, 4.0, 3.0], "fused_update": [1.0, 4.0, 6.0],
                                "param_dtype_grads": [2.0, 2.0, 3.0]}, names, 3)
    assert speed["fused_update"] == {"default_ms": 3.0, "variant_ms": 4.0, "speedup": 1.0, "speedup_min": 0.5,
                                     "speedup_max": 2.0}
    assert speed["param_dtype_grads"]["speedup"] == 1.0 and speed["param_dtype_grads"]["speedup_max"] == 2.0
    calls = []
    timed = variants._interleaved(lambda: calls.append(torch_bn_grad.config.cuda_variants), names, 2, 0.001)
    assert set(timed) == set(names) and all(r["default_ms"] > 0 and r["variant_ms"] > 0 for r in timed.values())
    assert {frozenset(), frozenset({names[0]}), frozenset({names[1]})} <= set(calls)
    assert torch_bn_grad.config.cuda_variants == frozenset()
