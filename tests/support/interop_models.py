"""The small network the interoperability tests (``test_interop_*.py``) share.

A Conv-BN-ReLU stem, a residual block (Conv-BN-ReLU, Conv-BN, add, ReLU), a
global pool and a head Linear-BN1d-ReLU-Linear: what a new user would try first.
:func:`twins` builds it twice with identical parameters and running
statistics: once with torch's BatchNorms, once converted with
``torch_bn_grad.convert_batchnorm``.
"""

from __future__ import annotations

import copy
from typing import Optional

import torch
from torch import Tensor, nn

import torch_bn_grad

CHANNELS = 8
FEATURES = 16
CLASSES = 5
INPUT_SHAPE = (4, 3, 10, 10)


class Block(nn.Module):
    """A residual block: conv-bn-relu, conv-bn, add the input, relu."""

    def __init__(self, channels: int, momentum: Optional[float]) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels, momentum=momentum)
        self.relu1 = nn.ReLU()
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels, momentum=momentum)
        self.relu2 = nn.ReLU()

    def forward(self, x: Tensor) -> Tensor:
        y = self.relu1(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return self.relu2(y + x)


class Net(nn.Module):
    """Conv-BN-ReLU stem, a residual block, pooling and a Linear-BN1d head."""

    def __init__(self, momentum: Optional[float] = 0.1) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, CHANNELS, 3, padding=1)
        self.bn = nn.BatchNorm2d(CHANNELS, momentum=momentum)
        self.relu = nn.ReLU()
        self.block = Block(CHANNELS, momentum)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.flatten = nn.Flatten()
        self.fc1 = nn.Linear(CHANNELS, FEATURES)
        self.bn_head = nn.BatchNorm1d(FEATURES, momentum=momentum)
        self.relu_head = nn.ReLU()
        self.fc2 = nn.Linear(FEATURES, CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        x = self.block(self.relu(self.bn(self.conv(x))))
        x = self.flatten(self.pool(x))
        return self.fc2(self.relu_head(self.bn_head(self.fc1(x))))


def randomize_batchnorms(model: nn.Module, generator: torch.Generator) -> nn.Module:
    """Non-trivial affine parameters and running statistics in every BatchNorm
    (those it has); returns the model."""
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                n = m.num_features
                if m.weight is not None:
                    m.weight.copy_(torch.rand(n, generator=generator) + 0.5)
                    m.bias.copy_(torch.randn(n, generator=generator) * 0.2)
                if m.running_mean is not None:
                    m.running_mean.copy_(torch.randn(n, generator=generator) * 0.1)
                    m.running_var.copy_(torch.rand(n, generator=generator) + 0.5)
                    m.num_batches_tracked.fill_(3)
    return model


def twins(momentum: Optional[float] = 0.1, train: bool = False) -> tuple[nn.Module, nn.Module]:
    """``(torch_model, converted_model)``: equal parameters and buffers, no shared tensors."""
    generator = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    reference = Net(momentum)
    randomize_batchnorms(reference, generator)
    reference.train(train)
    ours = torch_bn_grad.convert_batchnorm(copy.deepcopy(reference))
    return reference, ours


def example_input(seed: int = 1, shape: tuple = INPUT_SHAPE) -> Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


BATCHNORM_TYPES = {
    torch_bn_grad.nn.BatchNorm1d: nn.BatchNorm1d,
    torch_bn_grad.nn.BatchNorm2d: nn.BatchNorm2d,
    torch_bn_grad.nn.BatchNorm3d: nn.BatchNorm3d,
}


def torch_type(module: nn.Module) -> type:
    """The type a torch twin has in place of ``module``: torch's class for this library's BatchNorms."""
    return BATCHNORM_TYPES.get(type(module), type(module))


def assert_same_state(reference: nn.Module, ours: nn.Module, **tolerance) -> None:
    """Every parameter and buffer equal (running statistics included)."""
    ref_state, our_state = reference.state_dict(), ours.state_dict()
    assert list(ref_state) == list(our_state)
    for key, value in ref_state.items():
        torch.testing.assert_close(our_state[key], value, msg=lambda m: f"{key}: {m}", **tolerance)
