"""The CPU output cache: large operator outputs reuse memory that is already mapped.

A training loop asks for the same output sizes at every step. A fresh large
allocation is mapped anew, and the kernel faults in and zeroes every page on
first touch, which costs as much as the batch-norm pass itself (several times
more with ``THP_MEM_ALLOC_ENABLE=1`` on kernels whose THP ``defrag`` setting is
``madvise``). So outputs of 1 MiB or more that are freed are kept, up to a byte
limit, and handed to the next output of the same size, as torch's CUDA caching
allocator does for GPU memory. The tensors are ordinary CPU tensors.

The limit is 2 GiB of idle memory by default; set ``TORCH_BN_GRAD_OUTPUT_CACHE_MB``
before import (``0`` turns the cache off) or call :func:`set_output_cache_limit`.
"""

from __future__ import annotations

from torch_bn_grad import _C

__all__ = ["empty_output_cache", "output_cache_info", "set_output_cache_limit"]


def output_cache_info() -> dict[str, int]:
    """Counters of the cache: ``limit_bytes``, ``idle_bytes``, ``idle_blocks``
    (freed outputs waiting for reuse), ``hits`` and ``misses`` (outputs of at
    least 1 MiB served from an idle block, or from a new one)."""
    return _C.output_cache_info()


def set_output_cache_limit(nbytes: int) -> None:
    """Keeps at most ``nbytes`` of idle output memory (``0`` disables the
    cache); idle blocks beyond the new limit are freed now."""
    _C.set_output_cache_limit(int(nbytes))


def empty_output_cache() -> None:
    """Returns every idle block to the system. Outputs still in use are not
    affected; they return to the cache when freed, up to the limit."""
    _C.empty_output_cache()
