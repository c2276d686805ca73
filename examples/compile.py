"""Train the example model (examples/common.py), with torch_bn_grad's BatchNorm, under torch.compile.

The model is compiled whole (``fullgraph=True``: a graph break would be an
error). Prints the compile times, that the compiled model matches eager, then
the loss and accuracy per epoch. With ``--timing-steps N`` it also prints the
median training-step time eager against compiled.

    python examples/compile.py [--epochs 2] [--batch-size 64] [--threads N] [--timing-steps 0]
"""

from __future__ import annotations

import copy
import time

import torch
from torch._dynamo.utils import counters

import torch_bn_grad
from common import fit, median_step_times, options, setup, train_step  # this script's directory


def main() -> None:
    parser = options(__doc__, default_epochs=2)
    parser.add_argument("--timing-steps", type=int, default=0)
    s = setup(parser.parse_args())
    eager = torch_bn_grad.convert_batchnorm(copy.deepcopy(s.reference))
    model = torch_bn_grad.convert_batchnorm(copy.deepcopy(s.reference))
    compiled = torch.compile(model, fullgraph=True)

    # The first calls compile: the training graph (forward and backward), then eval.
    x, y = s.train_x[:s.args.batch_size], s.train_y[:s.args.batch_size]
    eager_loss = train_step(eager, torch.optim.SGD(eager.parameters(), lr=0.0), x, y)
    start = time.perf_counter()
    compiled_loss = train_step(compiled, torch.optim.SGD(model.parameters(), lr=0.0), x, y)
    train_compile = time.perf_counter() - start
    eager.eval()
    model.eval()
    with torch.no_grad():
        eager_logits = eager(s.test_x)
        start = time.perf_counter()
        compiled_logits = compiled(s.test_x)
        eval_compile = time.perf_counter() - start
    print(f"compile time: training step {train_compile:.1f} s, eval {eval_compile:.1f} s; "
          f"graph breaks: {sum(counters['graph_break'].values())}")
    print(f"compiled vs eager: loss difference {abs(compiled_loss - eager_loss).item():.2e}, "
          f"eval logits max difference {(compiled_logits - eager_logits).abs().max().item():.2e}")

    fit(model, s, run=compiled)

    if s.args.timing_steps:
        # Same weights, eager vs compiled, steps interleaved (both already warm).
        eager.load_state_dict(model.state_dict())
        eager.train()
        model.train()
        medians = median_step_times({"eager": (eager, eager), "compiled": (compiled, model)}, s,
                                    s.args.timing_steps)
        shape = f"batch {s.args.batch_size}, {s.args.image_size}x{s.args.image_size}, channels_last"
        print(f"median training step ({shape}): eager {medians['eager'] * 1e3:.2f} ms, "
              f"torch.compile {medians['compiled'] * 1e3:.2f} ms, "
              f"speedup {medians['eager'] / medians['compiled']:.2f}x")


if __name__ == "__main__":
    main()
