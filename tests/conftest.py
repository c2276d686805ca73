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


def pytest_report_header(config: pytest.Config) -> str:
    """Say which devices the device-generic tests run on."""
    if "cuda" not in DEVICES:
        return "torch_bn_grad test devices: cpu (no CUDA device: CUDA cases not generated)"
    return f"torch_bn_grad test devices: cpu, cuda ({torch.cuda.get_device_name()})"
