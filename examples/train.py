"""The main job: train a small ResNet-style CNN with torch_bn_grad's BatchNorm.

``convert_batchnorm`` replaces the model's torch BatchNorm layers with this
library's; the model then trains as before, on built-in synthetic data (no
download). Prints the loss and test accuracy per epoch.

    python examples/train.py [--epochs 3] [--batch-size 64] [--threads N]
"""

from __future__ import annotations

import torch_bn_grad
from common import fit, options, setup  # this script's directory


def main() -> None:
    s = setup(options(__doc__, default_epochs=3).parse_args())
    model = torch_bn_grad.convert_batchnorm(s.reference)
    n_bn = sum(type(m).__module__ == "torch_bn_grad.nn" for m in model.modules())
    print(f"model: {sum(p.numel() for p in model.parameters())} parameters, {n_bn} torch_bn_grad BatchNorm layers")
    fit(model, s)


if __name__ == "__main__":
    main()
