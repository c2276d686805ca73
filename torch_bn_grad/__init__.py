"""torch_bn_grad: fused, exact and fast batch-normalization operators for PyTorch.

Operators (registered under ``torch.ops.torch_bn_grad``):
:func:`batch_norm_forward`, :func:`batch_norm_backward`, and the fused
batch norm + residual + activation :func:`batch_norm_act_forward`, :func:`batch_norm_act_backward`.
Autograd: :class:`BatchNormFunction`. Functional: :mod:`torch_bn_grad.functional`.
Modules: :mod:`torch_bn_grad.nn` (``SyncBatchNorm`` and the fused ``BatchNormAct1d/2d/3d``,
``SyncBatchNormAct`` included) and :func:`convert_batchnorm` (``fuse=True`` fuses BatchNorm + activation).
Split-stage operators for statistics across processes: :mod:`torch_bn_grad.stages`.
The CPU output cache: :mod:`torch_bn_grad.memory`.
"""

import torch  # noqa: F401  (loads libc10/libtorch, which the extension links against)

from torch_bn_grad import _C, _library

_library.register()  # the operators, and all torch learns of them beyond their C++ kernels

from torch_bn_grad import config, errors, functional, memory, nn, stages  # noqa: E402
from torch_bn_grad._conversion.fold import fold_conv_batchnorm  # noqa: E402
from torch_bn_grad._conversion.revert import revert_batchnorm  # noqa: E402
from torch_bn_grad.autograd import BatchNormFunction  # noqa: E402
from torch_bn_grad.nn import BatchNormActSequential, convert_batchnorm  # noqa: E402
from torch_bn_grad.ops import (  # noqa: E402
    batch_norm_act_backward, batch_norm_act_forward, batch_norm_backward, batch_norm_forward,
)

__all__ = [
    "BatchNormActSequential",
    "BatchNormFunction",
    "config",
    "batch_norm_act_backward",
    "batch_norm_act_forward",
    "batch_norm_backward",
    "batch_norm_forward",
    "convert_batchnorm",
    "errors",
    "fold_conv_batchnorm",
    "functional",
    "memory",
    "nn",
    "revert_batchnorm",
    "stages",
]

__version__ = "0.1.0"


def cpu_kernel_isa() -> str:
    """Instruction set of the CPU kernels in use: ``"DEFAULT"``, ``"AVX2"`` or ``"AVX512"``."""
    return _C.cpu_kernel_isa()


def compiled_cpu_kernel_isas() -> tuple[str, ...]:
    """Instruction sets the CPU kernels were compiled for, lowest first
    (``TORCH_BN_GRAD_CPU_ISA`` at build time; by default the one the building CPU runs)."""
    return tuple(_C.compiled_cpu_kernel_isas().split(","))
