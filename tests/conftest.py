"""The device parametrization shared by the tests, and each pytest-xdist
worker's share of the CPUs.

A test that takes a ``device`` argument runs once per entry of
``support.reference.DEVICES``: on the CPU, and on CUDA where it is available.
Where it is not, no CUDA case is generated (nothing is skipped), and
``cuda/test_cuda.py``, whose tests all need a GPU, is not collected.
"""

from __future__ import annotations

import os

import pytest
import torch

from support.reference import DEVICES

collect_ignore = [] if "cuda" in DEVICES else ["cuda/test_cuda.py"]

TESTS = os.path.dirname(os.path.abspath(__file__))

# The items that take longest (minutes on 2 busy CPUs; seconds-long items are not
# listed), longest first: a node-id prefix under tests/ each. They are handed out
# first, so that no worker starts one while the others are running out of work.
LONG_FIRST = (
    "install/test_cuda_build.py",
    "operators/test_large_tensors.py",
    "operators/test_partial_vector_tails.py",
    "masked/test_batch_norm_masked.py::test_float64_results_do_not_depend_on_the_schedule",
    "compile/test_compile.py::test_aot_inductor_package_runs_in_fresh_process",
    "bench/test_model_bench.py",
    "operators/test_small_planes.py",
    "fused/test_batch_norm_act.py::test_every_isa_kernel_agrees",
    "distributed/test_distributed.py",
    "operators/test_few_rows_many_channels.py",
    "operators/test_narrow_channel_layouts.py::test_narrow_channel_counts_on_every_isa",
    "bench/test_bench_install.py",
    "bench/test_fused_bench.py",
    "masked/test_masked_lengths.py::test_sync_batch_norm_over_ranks_lengths_equal_the_mask",
    "distributed/test_nonfinite_stats_distributed.py",
    "interop/test_artifacts.py",
    "operators/test_ops.py::test_every_isa_kernel_agrees",
    "distributed/test_fused_distributed.py",
)


@pytest.fixture(scope="session", params=DEVICES)
def device(request: pytest.FixtureRequest) -> str:
    """The device a test's tensors live on ("cpu" or "cuda").

    Session-scoped so that hypothesis tests may take it too."""
    return request.param


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist (``-n auto``), each worker takes its share of the
    CPUs for torch's intra-op threads: workers that each start one thread per
    CPU oversubscribe the machine, and OpenMP's spinning threads then wait on
    each other. Tests that need a given thread count set it themselves."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // workers))


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the xdist_group marks
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The order and grouping the workers of ``-n auto`` get their work in
    (pyproject's ``--dist loadgroup`` hands out one group, or one test, at a
    time, in collection order, to whichever worker is running out).

    * The ``LONG_FIRST`` items first, in its order; the rest as collected.
    * Each module's tests that share a module- or class-scoped fixture in one
      group (``xdist_group``), so that one worker computes it once.
    """
    missing = [prefix for prefix in LONG_FIRST if not os.path.exists(os.path.join(TESTS, prefix.split("::")[0]))]
    if missing:
        raise pytest.UsageError(f"tests/conftest.py LONG_FIRST names files that do not exist: {missing}")

    def rank(item: pytest.Item) -> int:
        path = os.path.relpath(item.path, TESTS).replace(os.sep, "/")
        name = f"{path}::{item.nodeid.split('::', 1)[-1]}"
        for position, prefix in enumerate(LONG_FIRST):
            if name == prefix or name.startswith(prefix + ("::" if prefix.endswith(".py") else "[")):
                return position
        return len(LONG_FIRST)

    items.sort(key=rank)  # stable: each module's tests keep their order
    for item in items:
        fixtures = getattr(item, "_fixtureinfo", None)
        shared = fixtures is not None and any(
            definitions[-1].scope in ("module", "class", "package")
            for definitions in fixtures.name2fixturedefs.values() if definitions)
        if shared and item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))


def pytest_report_header(config: pytest.Config) -> str:
    """Say which devices the device-generic tests run on."""
    if "cuda" not in DEVICES:
        return "torch_bn_grad test devices: cpu (no CUDA device: CUDA cases not generated)"
    return f"torch_bn_grad test devices: cpu, cuda ({torch.cuda.get_device_name()})"
