"""timm's ImageNet models for the model benchmark (``python -m torch_bn_grad.bench
--model efficientnet_b0``): networks whose layers the ResNets do not have, with
their BatchNorm written as timm writes it (``BatchNormAct2d``: norm, drop and
activation in one module, which ``convert_batchnorm(fuse=True)`` turns into the
fused module with its SiLU or ReLU). Their channel counts (24, 40, 80, 112,
192, 320 in EfficientNet-B0; 16, 24, 40, 80, 112, 160, 960 in MobileNetV3) are
not all multiples of a vector of 16 or 32 lanes, and they activate with SiLU
(EfficientNet) or ReLU and hard-swish (MobileNetV3). Needs timm (in
requirements-test.txt); the model is built only when asked for.
"""

from __future__ import annotations

from functools import partial

from torch import nn

NAMES = ("efficientnet_b0", "mobilenetv3_large_100")


def build(name: str, num_classes: int = 1000) -> nn.Module:
    """timm's `name`, randomly initialized, with `num_classes` outputs."""
    try:
        import timm
    except ImportError as e:  # a clear error instead of a traceback deep in the benchmark
        raise SystemExit(f"--model {name} needs timm: python -m pip install -r requirements-test.txt") from e
    return timm.create_model(name, pretrained=False, num_classes=num_classes)


MODELS = {name: partial(build, name) for name in NAMES}
