"""The one home of the private torch APIs this package uses, behind a version check.

Each is looked up once, here. Those the core needs are looked up at import: a
torch release that moves or drops one fails at import with a message naming
it, instead of somewhere deep in a training step. Those of optional features
(the lowering under inductor, quantization's tables) are looked up when first
needed and raise :class:`PrivateAPIMissing`, which their module turns into a
warning and the feature off. The versions below are those the project is
tested with (README, "Set up").
"""

from __future__ import annotations

import importlib
import inspect
import sys
from typing import Any, Callable, Optional

import torch

TESTED_TORCH = ((2, 13), (2, 14))  # (major, minor) releases the test suite runs on
TORCH_VERSION = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])


# torch >= 2.14's BatchNorm takes bias= (an affine BatchNorm without beta);
# earlier releases (2.11) do not.
_BATCHNORM_TAKES_BIAS = "bias" in inspect.signature(torch.nn.modules.batchnorm._BatchNorm.__init__).parameters


def batchnorm_bias_kwargs(bias: bool) -> dict[str, bool]:
    """The ``bias`` keyword for ``_BatchNorm.__init__``, where this torch takes it.

    Without it only ``bias=True`` (torch's one behaviour there) is possible."""
    if _BATCHNORM_TAKES_BIAS:
        return {"bias": bias}
    if not bias:
        raise TypeError(f"bias=False needs a torch whose BatchNorm takes it (2.14 or later); "
                        f"torch {torch.__version__} does not")
    return {}


def torch_version_string() -> str:
    """The tested torch releases, for messages."""
    return ", ".join(".".join(map(str, v)) for v in TESTED_TORCH)


def _lookup(module: str, name: str) -> Any:
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as error:
        raise ImportError(
            f"torch_bn_grad needs {module}.{name}, which torch {torch.__version__} does not have "
            f"(tested with torch {torch_version_string()})"
        ) from error


# Autograd kernels that also work under torch.func (see _library/autograd_kernel.py).
enable_single_level_autograd_function = _lookup("torch._functorch.utils", "enable_single_level_autograd_function")
AutoDispatchBelowAutograd = _lookup("torch._C", "_AutoDispatchBelowAutograd")
OpOverload = _lookup("torch._ops", "OpOverload")
# An autograd.Function whose apply records one node and never reroutes to
# torch.func's custom_function_call (torch >= 2.14 reroutes the C++ apply too).
SingleLevelFunction = _lookup("torch.autograd.function", "_SingleLevelFunction")


# A tensor that torch.func wraps (vmap's BatchedTensor, grad's GradTrackingTensor).
is_functorch_wrapped_tensor = _lookup("torch._C._functorch", "is_functorch_wrapped_tensor")


# Traceable collectives for SyncBatchNorm (distributed.py).
functional_collectives = (
    importlib.import_module("torch.distributed._functional_collectives") if torch.distributed.is_available() else None
)


# Functional all-gather along a dim, ``(tensor, gather_dim, group)``: ``all_gather_single``
# on torch 2.14, ``all_gather_tensor`` (the same signature and result) before it.
all_gather_single: Optional[Callable[..., Any]] = None
if functional_collectives is not None:
    all_gather_single = (getattr(functional_collectives, "all_gather_single", None)
                         or functional_collectives.all_gather_tensor)


def _onnx_export_flags():
    """The two exporters' "exporting now" flags, or None where this torch keeps them elsewhere."""
    try:
        from torch.onnx._internal.exporter import _flags
        from torch.onnx._internal.torchscript_exporter._globals import GLOBALS
    except ImportError:
        return None
    if not hasattr(GLOBALS, "in_onnx_export") or not hasattr(_flags, "_is_onnx_exporting"):
        return None
    return GLOBALS, _flags


_ONNX_FLAGS = _onnx_export_flags()


def in_onnx_export() -> bool:
    """``torch.onnx.is_in_onnx_export()`` without its two imports per call (on
    every BatchNorm forward); the public function where this
    torch keeps the flags elsewhere."""
    if _ONNX_FLAGS is None or torch.compiler.is_compiling():  # dynamo skips torch.onnx's internals
        return torch.onnx.is_in_onnx_export()
    return _ONNX_FLAGS[0].in_onnx_export or _ONNX_FLAGS[1]._is_onnx_exporting


_TRACING_STATE = getattr(torch._C, "_get_tracing_state", None)


def jit_tracing() -> bool:
    """``torch.jit.is_tracing()`` without its Python frame (on every eval
    forward, where the frame is most of its cost); dynamo folds both to False."""
    if _TRACING_STATE is None:
        return torch.jit.is_tracing()
    return _TRACING_STATE() is not None


# ------------------------------------------------------------------ optional private APIs
# The features below are optional: where torch lacks what they need, the feature
# is off (with a warning, said by its module) and the rest of the library works.
# Each is looked up when first needed, not at import (importing inductor or
# quantization costs seconds), and raises PrivateAPIMissing with the reason.


class PrivateAPIMissing(RuntimeError):
    """An optional private torch API is missing or not as expected; the message says which."""


# Inductor (the lowering under torch.compile: _compile/lowering.py, registered by _compile/inductor.py).
INDUCTOR_MIN_TORCH = (2, 5)
INDUCTOR_DECOMPOSITION_MODULE = "torch._inductor.decomposition"


def inductor_config() -> Any:
    """``torch._inductor.config`` if inductor is loaded, else None (it is never imported here)."""
    return sys.modules.get("torch._inductor.config")


def _check_inductor_version() -> None:
    if TORCH_VERSION < INDUCTOR_MIN_TORCH:
        raise PrivateAPIMissing(f"torch {torch.__version__} is older than {'.'.join(map(str, INDUCTOR_MIN_TORCH))}")


def _inductor_lacks(what: str) -> PrivateAPIMissing:
    return PrivateAPIMissing(f"torch {torch.__version__}'s inductor lacks the private API this library's lowering "
                             f"uses ({what})")


def inductor_decompositions(module: Any) -> tuple[dict, Callable[[], dict], Any]:
    """(decomposition table, ``fast_random_decomps`` (cached copy of the table), inductor's config)
    from ``module``, the executed ``torch._inductor.decomposition``."""
    _check_inductor_version()
    table = getattr(module, "decompositions", None)
    fast = getattr(module, "fast_random_decomps", None)
    config = inductor_config()
    if (
        isinstance(table, dict)
        and callable(fast)
        and hasattr(fast, "cache_info")
        and isinstance(getattr(config, "unsafe_marked_cacheable_functions", None), dict)
    ):
        return table, fast, config
    raise _inductor_lacks("table")


def inductor_fallback() -> Optional[Callable[..., None]]:
    """A function ``fallback(op, same_layout=())`` that registers inductor's fallback (an extern
    call) for an operator, as inductor makes for operators it has no lowering for; None when
    inductor's lowerings are not loaded (not compiling with inductor: nothing to register).

    ``same_layout`` names full-size tensor arguments of ``op`` (schema names): at lowering,
    those whose layout inductor has not fixed yet (a fused kernel's output, say) are laid
    out in the stride order of the first one that has a fixed layout, instead of inductor's
    default (contiguous), so that the operator does not copy them into its anchor's layout."""
    _check_inductor_version()
    lowering = sys.modules.get("torch._inductor.lowering")
    library_utils = importlib.import_module("torch._library.utils")
    get_tag = getattr(library_utils, "get_layout_constraint_tag", None)
    if lowering is None:
        return None
    if not (all(hasattr(lowering, n) for n in ("lowerings", "make_fallback", "tag_to_layout_constraint")) and get_tag):
        raise _inductor_lacks("fallback")

    def fallback(op: Any, same_layout: tuple[str, ...] = ()) -> None:
        if op not in lowering.lowerings:
            constraint = lowering.tag_to_layout_constraint(get_tag(op, with_default=True))
            lowering.make_fallback(op, layout_constraint=constraint, override_decomp=True)
            if same_layout:
                lowering.lowerings[op] = _lowering_with_same_layout(lowering.lowerings[op], op, same_layout)

    return fallback


def _inductor_ir() -> tuple[Any, Any]:
    """(``torch._inductor.ir``, ``torch._inductor.virtualized.V``), checked for what
    ``_lowering_with_same_layout`` uses."""
    ir = importlib.import_module("torch._inductor.ir")
    virtualized = importlib.import_module("torch._inductor.virtualized")
    extern = getattr(ir, "ExternKernel", None)
    if not (all(hasattr(ir, n) for n in ("IRNode", "FlexibleLayout", "get_stride_order"))
            and hasattr(extern, "require_stride_order") and hasattr(ir.IRNode, "maybe_get_layout")
            and hasattr(virtualized, "V")):
        raise _inductor_lacks("layouts")
    return ir, virtualized.V


def _lowering_with_same_layout(lower: Callable, op: Any, names: tuple[str, ...]) -> Callable:
    """``lower`` (an operator's fallback lowering) after laying out the not yet fixed
    arguments among ``names`` in the stride order of the first fixed one."""
    ir, V = _inductor_ir()
    positions = {a.name: i for i, a in enumerate(op._schema.arguments)}
    slots = [(positions[name], name) for name in names]

    def fixed_order(node: Any) -> Optional[list[int]]:
        layout = node.maybe_get_layout()
        if layout is None or isinstance(layout, ir.FlexibleLayout):
            return None
        return ir.get_stride_order(layout.stride, V.graph.sizevars.shape_env)

    def lowering_with_same_layout(*args: Any, **kwargs: Any) -> Any:
        args = list(args)

        def get(i: int, name: str) -> Any:
            return args[i] if i < len(args) else kwargs.get(name)

        tensors = [(i, name, get(i, name)) for i, name in slots]
        tensors = [(i, name, t) for i, name, t in tensors if isinstance(t, ir.IRNode)]
        anchor = next((order for _, _, t in tensors if (order := fixed_order(t)) is not None), None)
        if anchor is not None:
            for i, name, t in tensors:
                if fixed_order(t) is None:
                    aligned = ir.ExternKernel.require_stride_order(t, anchor)
                    if i < len(args):
                        args[i] = aligned
                    else:
                        kwargs[name] = aligned
        return lower(*args, **kwargs)

    return lowering_with_same_layout


def inductor_compile_fx() -> Callable:
    """Inductor's backend function ``compile_fx(gm, example_inputs)`` (for a backend of one's own)."""
    return _lookup("torch._inductor.compile_fx", "compile_fx")


def inductor_kernel_profile() -> None:
    """Names inductor's CPU kernels in torch.profiler's tables (``config.cpp.enable_kernel_profile``,
    set before compiling); without it a compiled step's fused kernels are anonymous
    (``benchmarks/profile_model.py --breakdown --compile``)."""
    cpp = getattr(importlib.import_module("torch._inductor.config"), "cpp", None)
    if cpp is None or not hasattr(cpp, "enable_kernel_profile"):
        raise _inductor_lacks("cpp.enable_kernel_profile")
    cpp.enable_kernel_profile = True


def aoti_load_package() -> Callable:
    """``torch._inductor.aoti_load_package`` (AOTInductor packages, artifacts.py)."""
    return _lookup("torch._inductor", "aoti_load_package")


def has_kernel(op_name: str, dispatch_key: str) -> bool:
    """Whether the dispatcher has a kernel of ``op_name`` (``ns::name``) for ``dispatch_key``."""
    return _dispatch_has_kernel_for_dispatch_key(op_name, dispatch_key)


_dispatch_has_kernel_for_dispatch_key = _lookup("torch._C", "_dispatch_has_kernel_for_dispatch_key")


def tracer_decomposition(op: Any) -> Optional[Callable]:
    """``op``'s entry in the decomposition table of the make_fx tracer now recording
    (inductor's under torch.compile and AOTInductor), or None. Functionalization
    decomposes a CompositeImplicitAutograd operator before that tracer sees it,
    so the operator's kernel looks its entry up itself (_library/frozen_composite.py)."""
    mode = torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.PROXY)
    table = getattr(mode, "decomposition_table", None)
    return None if table is None else table.get(op)


# Quantization (FX leaves, fusion and backend tables, _interop/quantization.py).
def quantization_internals() -> dict[str, Any]:
    """The private quantization tables and classes that _interop/quantization.py extends, checked.

    Raises PrivateAPIMissing naming the torch version and the missing piece when
    torch's quantization internals are not as expected."""
    problem = None
    try:
        fuser_method_mappings = importlib.import_module("torch.ao.quantization.fuser_method_mappings")
        quantization_mappings = importlib.import_module("torch.ao.quantization.quantization_mappings")
        backend_config = importlib.import_module("torch.ao.quantization.backend_config")
        lower_to_native = importlib.import_module("torch.ao.quantization.fx._lower_to_native_backend")
        tracer = importlib.import_module("torch.ao.quantization.fx.tracer")
        BackendConfig, BackendPatternConfig = backend_config.BackendConfig, backend_config.BackendPatternConfig
        found = {
            "fuser_methods": getattr(fuser_method_mappings, "_DEFAULT_OP_LIST_TO_FUSER_METHOD", None),
            "static_quant_modules": getattr(quantization_mappings, "DEFAULT_STATIC_QUANT_MODULE_MAPPINGS", None),
            "lower_modules": getattr(lower_to_native, "SPECIAL_PATTERN_LOWER_MODULE_MAP", None),
            "BackendConfig": BackendConfig,
            "QuantizationTracer": tracer.QuantizationTracer,
        }
        for name in ("fuser_methods", "static_quant_modules", "lower_modules"):
            if not isinstance(found[name], dict):
                problem = f"{name} table not found"
        probe = BackendPatternConfig()
        if not all(hasattr(probe, a) for a in ("pattern", "_pattern_complex_format", "fuser_method")):
            problem = "BackendPatternConfig lacks pattern/_pattern_complex_format/fuser_method"
        if not hasattr(BackendConfig, "set_backend_pattern_config"):
            problem = "BackendConfig.set_backend_pattern_config not found"
    except (ImportError, AttributeError) as error:
        problem = str(error)
    if problem is not None:
        raise PrivateAPIMissing(
            f"torch_bn_grad: torch {torch.__version__}'s quantization internals changed ({problem}); "
            "fuse_modules, prepare_fx/convert_fx and FX tracing may not recognize torch_bn_grad's "
            "BatchNorms. Please report this with your torch version."
        )
    return found
