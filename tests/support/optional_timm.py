"""timm where it imports (it needs the torchvision built for this torch), and
the mark of the tests that need it."""

from __future__ import annotations

import pytest

try:
    import timm
    import timm.layers
except Exception as exc:  # noqa: BLE001 (any import failure: torchvision mismatch, missing package)
    timm = None
    SKIP = f"timm does not import here ({type(exc).__name__}: {exc})"
else:
    SKIP = ""

needs_timm = pytest.mark.skipif(timm is None, reason=SKIP)
