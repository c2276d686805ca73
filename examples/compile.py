"""Train the example ResNet of examples/train.py, with torch_bn_grad's BatchNorm, under torch.compile.

The model is compiled whole (``fullgraph=True``: a graph break would be an
error). Prints the compile times, that the compiled model matches eager, the
loss and accuracy per epoch, and the median training-step time eager vs compiled.

    python examples/compile.py [--epochs 2] [--batch-size 64] [--threads N]
"""

from __future__ import annotations

import copy
import time

import torch
from torch import nn
from torch._dynamo.utils import counters

import torch_bn_grad
from train import median_step_times, setup


def timed(fn, *args):
    """``fn(*args)`` and its wall time in seconds."""
    start = time.perf_counter()
    result = fn(*args)
    return result, time.perf_counter() - start


def train_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Forward, backward and an optimizer step; returns the loss."""
    loss = nn.functional.cross_entropy(model(x), y)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return loss.detach()


def main() -> None:
    s = setup(__doc__, default_epochs=2)
    args, g, reference = s.args, s.generator, s.reference
    train_x, train_y, test_x, test_y = s.train_x, s.train_y, s.test_x, s.test_y
    split = len(train_x)
    eager = torch_bn_grad.convert_batchnorm(copy.deepcopy(reference))
    model = torch_bn_grad.convert_batchnorm(copy.deepcopy(reference))
    compiled = torch.compile(model, fullgraph=True)

    # The first calls compile: the training graph (forward and backward), then eval.
    x, y = train_x[:args.batch_size], train_y[:args.batch_size]
    eager_loss = train_step(eager, torch.optim.SGD(eager.parameters(), lr=0.0), x, y)
    compiled_loss, train_compile = timed(train_step, compiled, torch.optim.SGD(model.parameters(), lr=0.0), x, y)
    eager.eval()
    model.eval()
    with torch.no_grad():
        eager_logits = eager(test_x)
        compiled_logits, eval_compile = timed(compiled, test_x)
    print(f"compile time: training step {train_compile:.1f} s, eval {eval_compile:.1f} s; "
          f"graph breaks: {sum(counters['graph_break'].values())}")
    print(f"compiled vs eager: loss difference {abs(compiled_loss - eager_loss).item():.2e}, "
          f"eval logits max difference {(compiled_logits - eager_logits).abs().max().item():.2e}")

    opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9, weight_decay=1e-4)
    start = time.perf_counter()
    for epoch in range(1, args.epochs + 1):
        model.train()
        perm = torch.randperm(split, generator=g)
        losses = [
            train_step(compiled, opt, train_x[idx], train_y[idx])
            for idx in perm[: split - split % args.batch_size].view(-1, args.batch_size)
        ]
        model.eval()
        with torch.no_grad():
            acc = (compiled(test_x).argmax(1) == test_y).float().mean().item()
        print(f"epoch {epoch}: train loss {torch.stack(losses).mean().item():.4f}, test accuracy {acc:.3f}")
    print(f"training took {time.perf_counter() - start:.1f} s")

    # Same weights, eager vs compiled, steps interleaved (both already warm).
    eager.load_state_dict(model.state_dict())
    eager.train()
    model.train()
    med_eager, med_compiled = median_step_times(eager, compiled, s)
    print(f"median training step (batch {args.batch_size}, {args.image_size}x{args.image_size}, channels_last): "
          f"eager {med_eager * 1e3:.2f} ms, torch.compile {med_compiled * 1e3:.2f} ms, "
          f"speedup {med_eager / med_compiled:.2f}x")


if __name__ == "__main__":
    main()
