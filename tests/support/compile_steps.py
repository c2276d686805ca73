"""What the torch.compile tests share: each test compiling from scratch, and
one SGD step through a model or its compiled form."""

from __future__ import annotations

from typing import Callable

import pytest
import torch
from torch._dynamo.utils import counters

from torch_bn_grad import config


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles from scratch, counts only its own graph breaks, and leaves
    ``config.compile_lowering`` as it found it."""
    torch._dynamo.reset()
    counters.clear()
    previous = config.compile_lowering
    yield
    config.compile_lowering = previous
    torch._dynamo.reset()


def sgd_step(run: Callable[[torch.Tensor], torch.Tensor], model: torch.nn.Module, x: torch.Tensor,
             target: torch.Tensor, backward: bool = True) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One SGD step through ``run`` (the model or its compiled form): the output, and the input
    and parameter gradients (none without ``backward``)."""
    x = x.clone().requires_grad_()
    out = run(x)
    if not backward:
        return out.detach(), []
    torch.nn.functional.cross_entropy(out.float(), target).backward()
    grads = [x.grad] + [p.grad.clone() for p in model.parameters()]
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.1 * p.grad
            p.grad = None
    return out.detach(), grads
