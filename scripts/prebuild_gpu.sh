#!/usr/bin/env bash
# Builds the extension here, without a GPU, for a GPU machine whose torch and
# Python are known, so that a short GPU run starts with a working build:
#
#     bash scripts/prebuild_gpu.sh            # torch 2.11.0 (CUDA 13.0), Python 3.12, sm_90
#
# TORCH (default 2.11.0), PYTHON_VERSION (default 3.12) and ARCH (default 9.0,
# H100/H200) name the target; they are the H100/H200 hosts' (docs/design.md,
# "CUDA variants"). PyPI's torch wheel of a release is the same build as the
# +cu130 one on download.pytorch.org (CUDA 13.0, cuDNN 9.19 for 2.11.0), so its
# headers and libraries give the same C++ and CUDA ABI.
#
# The interpreter of that version comes from $PYTHON312 (any path), else
# pyenv, else PATH. A virtual environment with that torch is made under
# build/gpu-prebuild/ (ignored by git; about 5 GB with the CUDA wheels torch
# imports), and the extension is built there with the CUDA kernels for ARCH
# and every CPU kernel copy (DEFAULT, AVX2, AVX512: the GPU host's CPU is
# not known here). The result is one file in torch_bn_grad/, ignored by git,
# beside the local Python's own: the extension `_C` with the target Python's
# EXT_SUFFIX (for Python 3.12 on x86_64, .cpython-312-x86_64-linux-gnu).
#
# Hand it over with the working tree (the device tool's `carry`);
# scripts/gpu_check.sh's build stage runs one CUDA forward with it and
# rebuilds on the GPU host only if that fails (another torch, another GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH="${TORCH:-2.11.0}"
PYTHON_VERSION="${PYTHON_VERSION:-3.12}"
ARCH="${ARCH:-9.0}"
PREFIX=build/gpu-prebuild
VENV="$PREFIX/venv-py$PYTHON_VERSION-torch$TORCH"

find_python() {
    local candidate
    for candidate in "${PYTHON312:-}" "$(command -v pyenv > /dev/null && pyenv prefix "$PYTHON_VERSION" 2>/dev/null)/bin/python" \
                     "$(command -v "python$PYTHON_VERSION" || true)"; do
        [ -n "$candidate" ] && [ -x "$candidate" ] &&
            "$candidate" -c "import sys; sys.exit(sys.version_info[:2] != tuple(map(int, '$PYTHON_VERSION'.split('.'))))" &&
            { echo "$candidate"; return 0; }
    done
    # pyenv's versions folder, where pyenv itself is not on PATH
    for candidate in "${PYENV_ROOT:-$HOME/.pyenv}"/versions/"$PYTHON_VERSION".*/bin/python; do
        [ -x "$candidate" ] && { echo "$candidate"; return 0; }
    done
    echo "prebuild_gpu: no Python $PYTHON_VERSION found (set PYTHON312=/path/to/python$PYTHON_VERSION)" >&2
    return 1
}

start=$SECONDS
if [ ! -x "$VENV/bin/python" ]; then
    "$(find_python)" -m venv "$VENV"
fi
PY="$VENV/bin/python"
if ! "$PY" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$TORCH')" 2>/dev/null; then
    # The build requirements but torch, then the target torch (its CUDA wheels come with it).
    grep -v '^torch==' requirements-build.txt | "$PY" -m pip install -q -r /dev/stdin
    "$PY" -m pip install -q "torch==$TORCH"
fi
"$PY" -c 'import sys, torch; print("prebuild_gpu: Python", sys.version.split()[0], "torch", torch.__version__, "CUDA", torch.version.cuda)'
echo "prebuild_gpu: environment ready in $((SECONDS - start)) s"

start=$SECONDS
TORCH_BN_GRAD_CUDA=1 TORCH_CUDA_ARCH_LIST="$ARCH" TORCH_BN_GRAD_CPU_ISA=all MAX_JOBS="$(nproc)" \
    "$PY" setup.py -q build_ext --inplace
SO=$("$PY" -c 'import sysconfig; print("torch_bn_grad/_C" + sysconfig.get_config_var("EXT_SUFFIX"))')
echo "prebuild_gpu: built $SO ($(du -h "$SO" | cut -f1)) in $((SECONDS - start)) s"
# It loads here, from the tree (the CPU operators run without a GPU).
"$PY" -c "
import torch, torch_bn_grad
y, mean, var = torch_bn_grad.batch_norm_forward(torch.randn(8, 4, 16))
print('prebuild_gpu: CPU forward ok with', torch_bn_grad.__file__, '- CUDA variants:', torch_bn_grad.config.cuda_variant_names())"
