"""Batch norm over padded sequences: a Conformer-style convolution block
(pointwise conv, GLU, depthwise conv, BatchNorm1d, SiLU, pointwise conv) run
on the same four utterances padded to two lengths.

torch's BatchNorm1d counts the padding in its statistics, so an utterance's
output (and the running statistics) depend on how much padding its batch
carries. The masked BatchNorm1d of torch_bn_grad takes the frames' mask and
normalizes over the valid frames only: the outputs do not depend on it;
BatchNormAct1d(activation="silu") does the same with the SiLU in the same
operator.

    python examples/masked.py
"""

from __future__ import annotations

import functools

import torch

import torch_bn_grad


class ConvModule(torch.nn.Module):
    """Conformer's convolution module over (batch, channels, frames) with a frame mask."""

    def __init__(self, channels: int, kernel_size: int = 15, batch_norm: type = torch.nn.BatchNorm1d) -> None:
        super().__init__()
        self.pointwise_in = torch.nn.Conv1d(channels, 2 * channels, 1)
        self.depthwise = torch.nn.Conv1d(channels, channels, kernel_size, padding=kernel_size // 2, groups=channels)
        self.norm = batch_norm(channels)
        self.pointwise_out = torch.nn.Conv1d(channels, channels, 1)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        valid = mask.unsqueeze(1)
        x = torch.nn.functional.glu(self.pointwise_in(x), dim=1)
        x = self.depthwise(x.masked_fill(~valid, 0.0))  # padding must not leak into the valid frames
        if isinstance(self.norm, torch_bn_grad.nn.BatchNormAct1d):  # masked batch norm and SiLU in one operator
            x = self.norm(x, mask=mask)
        elif isinstance(self.norm, torch_bn_grad.nn.BatchNorm1d):
            x = torch.nn.functional.silu(self.norm(x, mask))
        else:
            x = torch.nn.functional.silu(self.norm(x))
        x = self.pointwise_out(x)
        return x.masked_fill(~valid, 0.0)


def padded(utterances: list[torch.Tensor], length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The utterances (C, T_i) padded with zeros to `length` frames, and their frame mask."""
    x = torch.zeros(len(utterances), utterances[0].shape[0], length)
    for i, u in enumerate(utterances):
        x[i, :, : u.shape[1]] = u
    lengths = torch.tensor([u.shape[1] for u in utterances])
    return x, torch.arange(length)[None, :] < lengths[:, None]


def main() -> None:
    torch.manual_seed(0)
    channels = 64
    utterances = [torch.randn(channels, n) + 0.5 for n in (120, 95, 160, 70)]
    # The same four utterances, padded to the longest (160 frames) or to a bucket of 400.
    batches = [padded(utterances, 160), padded(utterances, 400)]

    fused = functools.partial(torch_bn_grad.nn.BatchNormAct1d, activation="silu")
    for name, norm in (("torch.nn.BatchNorm1d", torch.nn.BatchNorm1d),
                       ("torch_bn_grad.nn.BatchNorm1d + mask", torch_bn_grad.nn.BatchNorm1d),
                       ("torch_bn_grad.nn.BatchNormAct1d + mask", fused)):
        outputs, running_vars = [], []
        for x, mask in batches:
            torch.manual_seed(1)  # the same weights for both paddings
            block = ConvModule(channels, batch_norm=norm).train()
            outputs.append(block(x, mask)[0, :, :120])
            running_vars.append(block.norm.running_var)
        out_diff = (outputs[0] - outputs[1]).abs().max().item()
        var_diff = (running_vars[0] - running_vars[1]).abs().max().item()
        print(f"{name:39s} padded to 160 vs 400 frames: max |output difference| = {out_diff:.3g}, "
              f"max |running_var difference| = {var_diff:.3g}")


if __name__ == "__main__":
    main()
