"""The optional private torch APIs (``torch_bn_grad._compat``): a torch too old or
without them gives PrivateAPIMissing with the reason, and the feature warns and stays off."""

from __future__ import annotations

import types

import pytest

from torch_bn_grad import _compat
from torch_bn_grad._compile import inductor as _inductor
from torch_bn_grad._compile import lowering as _lowering


def test_inductor_version_gate(monkeypatch):
    monkeypatch.setattr(_compat, "TORCH_VERSION", (2, 4))
    with pytest.raises(_compat.PrivateAPIMissing, match="older than 2.5"):
        _compat.inductor_decompositions(types.ModuleType("decomposition"))
    with pytest.raises(_compat.PrivateAPIMissing, match="older than 2.5"):
        _compat.inductor_fallback()


def test_inductor_table_missing_warns_and_stays_opaque(monkeypatch):
    monkeypatch.setattr(_inductor, "_registered", False)
    monkeypatch.setattr(_lowering, "_warned", False)
    with pytest.warns(RuntimeWarning, match=r"lacks the private API .*\(table\).*stay opaque"):
        assert _inductor._register(types.ModuleType("decomposition")) is False
    assert not _inductor.is_registered()


def test_core_lookup_names_what_is_missing():
    with pytest.raises(ImportError, match=r"needs torch\._C\._no_such_api, which torch .* does not have"):
        _compat._lookup("torch._C", "_no_such_api")
