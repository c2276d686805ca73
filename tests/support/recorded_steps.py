"""Training steps recorded for comparison: what a rank runs on its slice of the
batch and what the single-process reference runs on the whole batch."""

from __future__ import annotations

from typing import Callable, Iterable

import torch


def record_steps(forward: Callable[[torch.Tensor], torch.Tensor], model: torch.nn.Module,
                 batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
                 keep: Callable[[torch.Tensor], torch.Tensor] = lambda t: t) -> dict:
    """``forward(x)`` and its backward with ``dy`` for each ``(x, dy)`` of ``batches``;
    per step, lists of the outputs, input gradients, ``model``'s parameter gradients
    and buffers (a snapshot) by name, each passed through ``keep`` (e.g. to the CPU)."""
    result: dict = {"outputs": [], "input_grads": [], "param_grads": [], "running": []}
    for x, dy in batches:
        x = x.detach().requires_grad_()
        model.zero_grad(set_to_none=True)
        out = forward(x)
        out.backward(dy)
        result["outputs"].append(keep(out.detach()))
        result["input_grads"].append(keep(x.grad))
        result["param_grads"].append({n: keep(p.grad) for n, p in model.named_parameters()})
        result["running"].append({n: keep(b.clone()) for n, b in model.named_buffers()})
    return result
