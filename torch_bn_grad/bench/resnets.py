"""ResNet-18 and ResNet-50 (He et al., 2015) with torch's BatchNorm2d, for the
model benchmark (``models.py``, ``python -m torch_bn_grad.bench --model``), so that it needs
no torchvision. Same layer structure as the usual ImageNet ResNets:
a 7x7 stride-2 stem with max pooling, four stages of basic (ResNet-18) or
bottleneck (ResNet-50) residual blocks, global average pooling, a linear head.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor, nn


def _act(negative_slope: Optional[float]) -> nn.Module:
    return nn.ReLU(inplace=True) if negative_slope is None else nn.LeakyReLU(negative_slope, inplace=True)


def _out_act(x: Tensor, negative_slope: Optional[float]) -> Tensor:
    return torch.relu(x) if negative_slope is None else torch.nn.functional.leaky_relu(x, negative_slope)


def _conv_bn(c_in: int, c_out: int, kernel: int, stride: int = 1) -> list[nn.Module]:
    return [nn.Conv2d(c_in, c_out, kernel, stride, padding=kernel // 2, bias=False), nn.BatchNorm2d(c_out)]


class _Basic(nn.Module):
    expansion = 1

    def __init__(self, c_in: int, width: int, stride: int, negative_slope: Optional[float] = None) -> None:
        super().__init__()
        self.negative_slope = negative_slope
        self.body = nn.Sequential(*_conv_bn(c_in, width, 3, stride), _act(negative_slope), *_conv_bn(width, width, 3))
        self.shortcut = _shortcut(c_in, width * self.expansion, stride)

    def forward(self, x: Tensor) -> Tensor:
        return _out_act(self.body(x) + self.shortcut(x), self.negative_slope)


class _Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, c_in: int, width: int, stride: int, negative_slope: Optional[float] = None) -> None:
        super().__init__()
        out = width * self.expansion
        self.negative_slope = negative_slope
        self.body = nn.Sequential(
            *_conv_bn(c_in, width, 1), _act(negative_slope),
            *_conv_bn(width, width, 3, stride), _act(negative_slope),
            *_conv_bn(width, out, 1),
        )
        self.shortcut = _shortcut(c_in, out, stride)

    def forward(self, x: Tensor) -> Tensor:
        return _out_act(self.body(x) + self.shortcut(x), self.negative_slope)


def _shortcut(c_in: int, c_out: int, stride: int) -> nn.Module:
    if stride == 1 and c_in == c_out:
        return nn.Identity()
    return nn.Sequential(*_conv_bn(c_in, c_out, 1, stride))


class ResNet(nn.Module):
    """A ResNet of ``block`` with ``depths`` blocks per stage; ReLU activations, or
    LeakyReLU with ``negative_slope`` (which ``memory_saving`` fusion can take)."""

    def __init__(self, block: type, depths: tuple[int, ...], num_classes: int = 1000,
                 negative_slope: Optional[float] = None) -> None:
        super().__init__()
        layers: list[nn.Module] = [*_conv_bn(3, 64, 7, 2), _act(negative_slope), nn.MaxPool2d(3, 2, 1)]
        c_in = 64
        for stage, depth in enumerate(depths):
            width = 64 * 2**stage
            for i in range(depth):
                layers.append(block(c_in, width, 2 if stage > 0 and i == 0 else 1, negative_slope))
                c_in = width * block.expansion
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(c_in, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.flatten(torch.nn.functional.adaptive_avg_pool2d(self.features(x), 1), 1))


def resnet18(num_classes: int = 1000, negative_slope: Optional[float] = None) -> ResNet:
    return ResNet(_Basic, (2, 2, 2, 2), num_classes, negative_slope)


def resnet50(num_classes: int = 1000, negative_slope: Optional[float] = None) -> ResNet:
    return ResNet(_Bottleneck, (3, 4, 6, 3), num_classes, negative_slope)


MODELS: dict[str, Callable[..., ResNet]] = {"resnet18": resnet18, "resnet50": resnet50}
