#!/usr/bin/env bash
# Everything a machine with an NVIDIA GPU and a CUDA build of torch can check,
# in one call from the repository root:
#
#     OUT=/some/dir bash scripts/gpu_check.sh [STAGE...]
#
# Stages, in this order (default: all): build, gpu-tests, bench, other-tests.
#   build        pip install --no-build-isolation -e . with the CUDA kernels, for this GPU's
#                architecture only, then one forward on the GPU
#   gpu-tests    the tests that run on CUDA (every "cuda" case, test_cuda.py)
#   bench        python -m torch_bn_grad.bench --device cuda
#   other-tests  the rest of the suite (CPU cases, nvcc compile check, distributed)
# The two test stages together are the whole suite (`python -m pytest`), run once;
# the GPU part comes first so that it is done even if a time limit cuts the run short.
# Logs go under $OUT (default /tmp/torch_bn_grad_gpu_check); summary.txt lists
# each stage's status and seconds. Exit status: non-zero if any stage failed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/torch_bn_grad_gpu_check}"
mkdir -p "$OUT"
: > "$OUT/summary.txt"
STAGES=("$@")
[ ${#STAGES[@]} -eq 0 ] && STAGES=(build gpu-tests bench other-tests)
export PYTHONUNBUFFERED=1  # logs stay complete up to the moment a time limit stops the run
# The interpreter that holds torch: $PYTHON, else python, else python3 (the H200
# machines have only python3). Not a symlink: a venv's python finds its
# packages through the path it was started by.
PY="${PYTHON:-$(command -v python || command -v python3)}"
failed=0

# Tests whose id names CUDA: the "cuda" device cases and test_cuda.py; the nvcc
# compile check (test_cuda_build.py) runs no GPU code and goes with the rest.
GPU_TESTS="cuda and not cuda_build"
PYTEST=("$PY" -m pytest -p no:cacheprovider -rs --durations=20 --continue-on-collection-errors)

run_stage() {  # run_stage NAME COMMAND...: log to $OUT/NAME.log, record status and time
    local name=$1 start=$SECONDS status
    shift
    echo "== $name: $*" | tee -a "$OUT/summary.txt"
    "$@" < /dev/null > "$OUT/$name.log" 2>&1  # nothing waits on a terminal's input
    status=$?
    echo "   $name: exit $status in $((SECONDS - start)) s" | tee -a "$OUT/summary.txt"
    [ $status -eq 0 ] || { failed=1; tail -n 30 "$OUT/$name.log"; }
    return $status
}

build() {
    # One architecture (this GPU's) halves the nvcc time; MAX_JOBS uses every core.
    TORCH_CUDA_ARCH_LIST="$("$PY" -c 'import torch; print("%d.%d" % torch.cuda.get_device_capability())')" \
    MAX_JOBS="$(nproc)" "$PY" -m pip install --no-build-isolation --no-deps -v -e . &&
    "$PY" -c 'import torch, torch_bn_grad
y, mean, var = torch_bn_grad.batch_norm_forward(torch.randn(8, 4, 16, device="cuda"))
torch.cuda.synchronize()
print("CUDA forward ok on", torch.cuda.get_device_name(), "- mean", mean.cpu().tolist())'
}

{
    date
    nvidia-smi
    nvcc --version
    "$PY" -c 'import sys, torch; print(sys.version); print("torch", torch.__version__, "CUDA", torch.version.cuda,
               "available", torch.cuda.is_available())'
    "$PY" -c 'import pytest, hypothesis, numpy; print("pytest", pytest.__version__, "hypothesis",
               hypothesis.__version__, "numpy", numpy.__version__)'
} > "$OUT/env.txt" 2>&1
if ! "$PY" -c 'import torch, sys; sys.exit(not torch.cuda.is_available())'; then
    echo "No usable CUDA device (see $OUT/env.txt); nothing to check." | tee "$OUT/summary.txt"
    exit 1
fi

for stage in "${STAGES[@]}"; do
    case $stage in
        build) run_stage build build || break ;;  # nothing else can run without the extension
        gpu-tests) run_stage gpu-tests "${PYTEST[@]}" -k "$GPU_TESTS" --junitxml="$OUT/gpu-tests.xml" ;;
        # GPU kernels take microseconds to milliseconds: 0.1 s per measurement is thousands of runs.
        bench) run_stage bench "$PY" -m torch_bn_grad.bench --device cuda --min-run-time 0.1 --json "$OUT/bench.json" ;;
        other-tests) run_stage other-tests "${PYTEST[@]}" -k "not ($GPU_TESTS)" --junitxml="$OUT/other-tests.xml" ;;
        *) echo "unknown stage: $stage (build, gpu-tests, bench, other-tests)"; exit 2 ;;
    esac
done
exit $failed
