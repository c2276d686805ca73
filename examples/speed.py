"""Training-step time of the example model (examples/common.py): torch's
BatchNorm against torch_bn_grad's as a drop-in (``convert_batchnorm``) and
fused with the activations (``convert_batchnorm(fuse=True)``: BatchNorm ->
ReLU and BatchNorm -> add -> ReLU become one operator each). Same weights,
steps interleaved in rounds; prints the median step time of each and the
speedup over torch's.

    python examples/speed.py [--batch-size 64] [--image-size 24] [--timing-steps 45] [--threads N]
"""

from __future__ import annotations

import copy

import torch_bn_grad
from common import median_step_times, options, setup  # this script's directory


def main() -> None:
    parser = options(__doc__, default_epochs=None)
    parser.add_argument("--timing-steps", type=int, default=45)
    s = setup(parser.parse_args())
    ours = torch_bn_grad.convert_batchnorm(copy.deepcopy(s.reference))
    fused = torch_bn_grad.convert_batchnorm(copy.deepcopy(s.reference), fuse=True)
    medians = median_step_times({"torch": (s.reference, s.reference), "ours": (ours, ours),
                                 "fused": (fused, fused)}, s, s.args.timing_steps)
    torch_ms, ours_ms, fused_ms = (medians[k] * 1e3 for k in ("torch", "ours", "fused"))
    shape = f"batch {s.args.batch_size}, {s.args.image_size}x{s.args.image_size}, channels_last"
    print(f"median training step ({shape}): torch BatchNorm {torch_ms:.2f} ms, torch_bn_grad {ours_ms:.2f} ms, "
          f"speedup {torch_ms / ours_ms:.2f}x")
    print(f"median training step, fused (convert_batchnorm(fuse=True)): torch BatchNorm {torch_ms:.2f} ms, "
          f"torch_bn_grad fused {fused_ms:.2f} ms, speedup {torch_ms / fused_ms:.2f}x")


if __name__ == "__main__":
    main()
