"""The device parametrization shared by the tests.

A test that takes a ``device`` argument runs once per entry of
``reference.DEVICES``: on the CPU, and on CUDA where it is available. Where it
is not, no CUDA case is generated (nothing is skipped), and ``test_cuda.py``,
whose tests all need a GPU, is not collected.
"""

from __future__ import annotations

import pytest
import torch

from reference import DEVICES

collect_ignore = [] if "cuda" in DEVICES else ["test_cuda.py"]


@pytest.fixture(scope="session", params=DEVICES)
def device(request: pytest.FixtureRequest) -> str:
    """The device a test's tensors live on ("cpu" or "cuda").

    Session-scoped so that hypothesis tests may take it too."""
    return request.param


def pytest_report_header(config: pytest.Config) -> str:
    """Say which devices the device-generic tests run on."""
    if "cuda" not in DEVICES:
        return "torch_bn_grad test devices: cpu (no CUDA device: CUDA cases not generated)"
    return f"torch_bn_grad test devices: cpu, cuda ({torch.cuda.get_device_name()})"
