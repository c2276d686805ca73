"""Registration of the operators' lowering (``_compile/lowering.py``, ``_compile/inductor_act.py``)
for torch.compile's inductor backend.

The rewrites go into inductor's decomposition table, a private API: it and
inductor's fallback registration are looked up in ``_compat`` (which checks
the torch version and the names used); where they are missing the operators
stay opaque, with one warning. The table is read from
``torch._inductor.decomposition``, which costs seconds to import; so it is
registered when that module is first imported (by the first inductor
compilation), through an import hook.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.abc
import importlib.util
import sys
import threading
from typing import Any


from torch_bn_grad import _compat, config
from torch_bn_grad._library import frozen_composite as _frozen_composite
from torch_bn_grad._compile import inductor_act as _inductor_act
from torch_bn_grad._compile import lowering as _lowering
from torch_bn_grad._compat import INDUCTOR_DECOMPOSITION_MODULE as _DECOMPOSITION_MODULE

# An entry of inductor's config that enters the compile caches' keys (FX graph
# cache and AOTAutograd cache), so that a compilation made with the lowering
# is never reused without it, and the reverse, nor one made by another version
# of this file. The name is no Python path, so
# that it marks no real function as cacheable.
_CACHE_KEY_NAME = "torch_bn_grad:compile_lowering"

_lock = threading.Lock()
_registered = False


def _register(decomposition: Any) -> bool:
    """Put the rewrites into inductor's decomposition table (``decomposition`` is
    ``torch._inductor.decomposition``). Returns whether they are in place."""
    global _registered
    with _lock:
        if _registered:
            return True
        try:
            table, fast, _ = _compat.inductor_decompositions(decomposition)
        except _compat.PrivateAPIMissing as missing:
            _lowering.warn_once(str(missing))
            return False
        ops = {**_lowering.rewrites(), **_inductor_act.rewrites(), **_frozen_composite.inductor_rewrites()}
        table.update(ops)
        # select_decomp_table() returns a cached copy of the table; fill it too if it is made already.
        if fast.cache_info().currsize:
            fast().update(ops)
        _registered = True
    sync_cache_key()
    return True


def sync_cache_key() -> None:
    """Put the current ``config.compile_lowering`` into inductor's config, which keys the compile caches."""
    inductor_config = _compat.inductor_config()
    if not _registered or inductor_config is None:
        return
    marked = dict(inductor_config.unsafe_marked_cacheable_functions)
    marked[_CACHE_KEY_NAME] = f"{'on' if config.compile_lowering else 'off'}:{_source_hash()}"
    inductor_config.unsafe_marked_cacheable_functions = marked


@functools.lru_cache(maxsize=None)
def _source_hash() -> str:
    """A hash of the rewrites' files, so that compilations cached by another version are not reused."""
    digest = hashlib.sha256()
    try:
        modules = (__file__, _compat.__file__, _lowering.__file__, _inductor_act.__file__, _frozen_composite.__file__)
        for module in modules:
            with open(module, "rb") as f:
                digest.update(f.read())
    except OSError:
        return "unknown"
    return digest.hexdigest()[:16]


def is_registered() -> bool:
    """Whether the rewrites are in inductor's decomposition table."""
    return _registered


class _PostImportHook(importlib.abc.MetaPathFinder):
    """Registers the rewrites right after ``torch._inductor.decomposition`` is executed."""

    def find_spec(self, fullname, path, target=None):
        if fullname != _DECOMPOSITION_MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader = spec.loader
        exec_module = loader.exec_module

        def exec_and_register(module):
            exec_module(module)
            _register(module)

        loader.exec_module = exec_and_register  # type: ignore[method-assign]
        return spec


def install() -> None:
    """Register now if inductor's decomposition table is loaded, else when it is."""
    module = sys.modules.get(_DECOMPOSITION_MODULE)
    if module is not None:
        _register(module)
    elif not any(isinstance(f, _PostImportHook) for f in sys.meta_path):
        sys.meta_path.insert(0, _PostImportHook())


def ensure_registered() -> bool:
    """Import inductor's decomposition table (seconds) and register; for tests and benchmarks."""
    return _register(importlib.import_module(_DECOMPOSITION_MODULE))


config.on_change(sync_cache_key)
