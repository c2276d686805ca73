"""Check torch_bn_grad's BatchNorm2d gradients numerically: ``gradcheck`` and
``gradgradcheck`` in float64, in training and in eval mode, through
``torch.func.functional_call`` (so the parameters' gradients are checked too).
Exits with status 1 if a check fails.

    python examples/gradcheck.py
"""

from __future__ import annotations

import torch

import torch_bn_grad


def check(training: bool, generator: torch.Generator) -> bool:
    bn = torch_bn_grad.nn.BatchNorm2d(3).double().train(training)
    with torch.no_grad():
        bn.weight.uniform_(0.5, 1.5, generator=generator)
        bn.bias.normal_(generator=generator)
        bn.running_var.uniform_(0.5, 1.5, generator=generator)
    x = torch.randn(2, 3, 3, 2, dtype=torch.float64, generator=generator, requires_grad=True)
    w = torch.randn(2, 3, 3, 2, dtype=torch.float64, generator=generator)

    def weighted(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        # A weighted output: a uniform upstream gradient would hide most of the gradient.
        return torch.func.functional_call(bn, {"weight": weight, "bias": bias}, (x,)) * w

    args = (x, bn.weight, bn.bias)
    return torch.autograd.gradcheck(weighted, args) and torch.autograd.gradgradcheck(weighted, args)


def main() -> None:
    g = torch.Generator().manual_seed(0)
    passed = True
    for training in (True, False):
        ok = check(training, g)
        passed &= ok
        print(f"gradcheck + gradgradcheck of torch_bn_grad BatchNorm2d (float64, "
              f"{'train' if training else 'eval'}): {'PASSED' if ok else 'FAILED'}")
    if not passed:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
