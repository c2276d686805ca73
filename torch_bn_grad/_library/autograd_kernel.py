"""Autograd kernels for the operators that also work under ``torch.func`` transforms.

``torch.library.register_autograd`` records its formula through
``autograd.Function.apply``, which under torch.func (``grad``, ``vjp``,
``jacrev``) reroutes to torch.func's ``custom_function_call`` and fails inside
a dispatcher kernel (pytorch/pytorch#168393). Yet the Autograd kernel of an
operator never needs that route: the dispatcher calls it once per
torch.func grad level with that level's tensors, as it does ATen's C++ Autograd
kernels, so a plain single-level autograd node is exactly right.
:func:`register_autograd` registers ``(backward, setup_context)`` (the
contract of ``torch.library.register_autograd``) that way.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch

from torch_bn_grad import _C
from torch_bn_grad._compat import (
    AutoDispatchBelowAutograd,
    OpOverload,
    SingleLevelFunction,
    enable_single_level_autograd_function,
)


def register_autograd(
    op: OpOverload,
    backward: Callable[..., Any],
    setup_context: Callable[[Any, tuple, Any], None],
    jvp: Callable[..., Any] | None = None,
) -> None:
    """Make ``backward``/``setup_context`` the Autograd kernel of ``op``, for
    autograd and torch.func alike; ``jvp`` (``autograd.Function``'s, given the
    tangents of every input) is its forward-mode formula, and without it
    forward-mode AD raises."""
    methods = {
        "forward": staticmethod(functools.partial(_forward_below_autograd, op)),
        "setup_context": staticmethod(setup_context),
        "backward": staticmethod(backward),
    }
    if jvp is not None:
        methods["jvp"] = staticmethod(jvp)
    function = type(f"{op._opname}_autograd", (SingleLevelFunction,), methods)  # SingleLevelFunction: see _compat
    plain_apply = function.apply

    def record(*args: Any) -> Any:
        # Called for dual inputs too: the Function's jvp runs, or, without
        # one, forward-mode AD raises instead of dropping tangents.
        # Allowed here, under torch.func, because this node is one level's.
        with enable_single_level_autograd_function():
            return plain_apply(*args)

    # A call that records nothing (no grad mode or no input requiring grad,
    # and no tangent) skips autograd in C++ (csrc/autograd/python_autograd.cpp); the
    # others call `record`.
    _C.register_python_autograd(op._opname, record)


def _forward_below_autograd(op: OpOverload, *args: Any) -> Any:
    """The Function's forward: ``op`` without this level's Autograd kernel.

    ``Function.apply`` turns grad mode off around the forward, but grad mode is
    global, so lower torch.func levels (whose Autograd kernels run inside this
    call) would then record nothing; excluding the Autograd keys skips this
    level alone, as ATen's own Autograd kernels do.
    """
    with torch.enable_grad(), AutoDispatchBelowAutograd():
        return op(*args)
