"""``torch_bn_grad.config.cuda_variants``, the switch of the CUDA variants (code
paths compiled into every CUDA build, off by default until a GPU run proves
them; docs/design.md, "CUDA variants"): its names, its checks, the
environment variable ``TORCH_BN_GRAD_CUDA_VARIANTS``, and that the CPU does
not depend on it. What each variant computes on a GPU:
tests/cuda/test_cuda_variants.py.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import torch_bn_grad
from torch_bn_grad import config


@pytest.fixture
def restored_variants():
    before = config.cuda_variants
    yield
    config.cuda_variants = before


def test_every_variant_is_named_and_none_is_on_by_default():
    names = config.cuda_variant_names()
    assert "fused_update" in names
    assert len(set(names)) == len(names) and all(n.isidentifier() for n in names)
    if not os.environ.get("TORCH_BN_GRAD_CUDA_VARIANTS"):
        assert config.cuda_variants == frozenset()


def test_set_and_read_back(restored_variants):
    config.cuda_variants = {"fused_update"}
    assert config.cuda_variants == frozenset({"fused_update"})
    config.cuda_variants = ["fused_update", "fused_update"]
    assert config.cuda_variants == frozenset({"fused_update"})
    config.cuda_variants = ()
    assert config.cuda_variants == frozenset()


def test_unknown_name_is_refused_and_changes_nothing(restored_variants):
    config.cuda_variants = {"fused_update"}
    with pytest.raises(ValueError, match=r"config\.cuda_variants: unknown CUDA variant 'fused_updat'; expected "
                                         r"names among .*fused_update"):
        config.cuda_variants = {"fused_update", "fused_updat"}
    assert config.cuda_variants == frozenset({"fused_update"})


@pytest.mark.parametrize("value", ["fused_update", 1, [1]], ids=["a bare str", "an int", "ints"])
def test_not_a_set_of_names_is_a_type_error(restored_variants, value):
    with pytest.raises(TypeError, match=r"config\.cuda_variants must be a set of str"):
        config.cuda_variants = value
    assert config.cuda_variants == frozenset()


def _import_with(value: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, TORCH_BN_GRAD_CUDA_VARIANTS=value)
    code = "import torch_bn_grad; print(sorted(torch_bn_grad.config.cuda_variants))"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)


def test_environment_variable_turns_variants_on():
    done = _import_with(" fused_update , ")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "['fused_update']"


def test_environment_variable_with_an_unknown_name_fails_at_import():
    done = _import_with("fused_update,nope")
    assert done.returncode != 0
    assert "TORCH_BN_GRAD_CUDA_VARIANTS: unknown CUDA variant 'nope'" in done.stderr


def test_cpu_training_step_does_not_depend_on_the_variants(restored_variants):
    torch.manual_seed(0)
    x = torch.randn(6, 5, 4, 3)
    results = []
    for variants in (frozenset(), frozenset(config.cuda_variant_names())):
        config.cuda_variants = variants
        m = torch_bn_grad.nn.BatchNorm2d(5)
        y = m(x.clone().requires_grad_())
        y.backward(torch.ones_like(y))
        results.append((y.detach(), m.running_mean.clone(), m.running_var.clone()))
    for a, b in zip(*results):
        assert torch.equal(a, b)
