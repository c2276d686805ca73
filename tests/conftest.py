"""The device parametrization shared by the tests, and each pytest-xdist
worker's share of the CPUs.

A test that takes a ``device`` argument runs once per entry of
``support.reference.DEVICES``: on the CPU, and on CUDA where it is available.
Where it is not, no CUDA case is generated (nothing is skipped), and
``cuda/test_cuda.py`` and ``cuda/test_cuda_variants.py``, whose tests all need
a GPU, are not collected.
"""

from __future__ import annotations

import os

import pytest
import torch

from support.reference import DEVICES

collect_ignore = [] if "cuda" in DEVICES else ["cuda/test_cuda.py", "cuda/test_cuda_variants.py"]

TESTS = os.path.dirname(os.path.abspath(__file__))

# The files whose tests take longest (a minute or more of tests on 2 busy CPUs),
# longest first. Under ``-n auto`` each file goes to one worker (pyproject's
# ``--dist loadfile``: a module-scoped fixture is computed once) in collection
# order; these go first, so that no worker starts one while the others run out
# of work.
LONG_FIRST = (
    "install/test_cuda_build.py",
    "operators/test_large_tensors.py",
    "bench/test_model_bench.py",
    "operators/test_partial_vector_tails.py",
    "compile/test_compile.py",
    "fused/test_batch_norm_act.py",
    "bench/test_fused_bench.py",
    "compile/test_compile_lowering.py",
    "bench/test_bench_install.py",
    "masked/test_batch_norm_masked.py",
    "operators/test_ops.py",
    "masked/test_masked_interop_onnx.py",
    "interop/test_artifacts.py",
    "install/test_install.py",
    "operators/test_small_planes.py",
    "distributed/test_distributed.py",
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


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The ``LONG_FIRST`` files' tests first, in its order; the others as collected."""
    missing = [path for path in LONG_FIRST if not os.path.isfile(os.path.join(TESTS, path))]
    if missing:
        raise pytest.UsageError(f"tests/conftest.py LONG_FIRST names files that do not exist: {missing}")
    rank = {os.path.join(TESTS, path): position for position, path in enumerate(LONG_FIRST)}
    items.sort(key=lambda item: rank.get(str(item.path), len(LONG_FIRST)))  # stable: a file's order is kept


def pytest_report_header(config: pytest.Config) -> str:
    """Say which devices the device-generic tests run on."""
    if "cuda" not in DEVICES:
        return "torch_bn_grad test devices: cpu (no CUDA device: CUDA cases not generated)"
    return f"torch_bn_grad test devices: cpu, cuda ({torch.cuda.get_device_name()})"
