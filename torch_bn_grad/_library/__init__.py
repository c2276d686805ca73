"""What torch learns of this library's operators beyond their schemas and C++
kernels, registered in one place (:func:`register`, which the package's
``__init__`` calls once): the Python autograd formulas (``autograd.py``,
``masked_autograd.py``, ``stages_autograd.py``, through ``autograd_kernel.py``),
the fake implementations (``fake.py``), the batching rules (``vmap.py``), the
eval forward's export overloads (``frozen_composite.py``), and the tools' hooks:
inductor's lowering (``_compile/inductor.py``), the TorchScript-based ONNX
exporter's symbolics (``_interop/onnx.py``), FX quantization's patterns
(``_interop/quantization.py``)."""

from __future__ import annotations


def register() -> None:
    """Registers everything above; the operators themselves come with the extension ``_C``."""
    from torch_bn_grad import _C  # noqa: F401  (the schemas and the C++ kernels)
    from torch_bn_grad._library import autograd, fake, frozen_composite, masked_autograd, stages_autograd, vmap  # noqa: F401  (register at import)
    from torch_bn_grad._compile import inductor
    from torch_bn_grad._interop import onnx, quantization

    inductor.install()  # torch.compile (inductor): the operators' lowering, see torch_bn_grad.config
    onnx.register()
    quantization.register_or_warn()
