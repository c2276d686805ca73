#!/usr/bin/env bash
# Everything a machine with an NVIDIA GPU and a CUDA build of torch can check,
# in one call from the repository root:
#
#     OUT=/some/dir bash scripts/gpu_check.sh [STAGE...]
#
# Stages, in the order given (default: build gpu-tests variants bench other-tests):
#   build        pip install --no-build-isolation -e . with the CUDA kernels, for this GPU's
#                architecture only, then one forward on the GPU; skipped when an extension
#                built in advance for this torch and Python (torch_bn_grad/_C*.so) already
#                runs that forward
#   gpu-tests    the tests that run on CUDA (every "cuda" case, tests/cuda/), 4 processes
#   variants     benchmarks/variants.py: every CUDA variant (config.cuda_variants) against the
#                default, interleaved in one process (op cases and the ResNet-50 step), then
#                scripts/choose_variants.py's choice from those times and gpu-tests.xml
#                (variants.json, variants_choice.json)
#   host-cost    benchmarks/host_cost.py: host time and launches per call (torch.profiler)
#   bench        python -m torch_bn_grad.bench --device cuda (ResNet-50 shapes at batch 32)
#   models       the ResNet-50 training step (batch 64, 224x224, channels_last, eager and
#                compiled; float32 and bfloat16 autocast), ours and fused against native
#   models-graphs  the same training step captured whole with torch.cuda.graph, float32
#   models-reduce-overhead  the same under torch.compile(mode="reduce-overhead") (three
#                compilations of ResNet-50: give it two minutes or more)
#   masked       benchmarks/masked.py --device cuda: masked vs unmasked vs the gather workaround
#   profile      benchmarks/profile_model.py --device cuda: kernel tables of a ResNet-50 step
#   other-tests  the rest of the suite (CPU cases, nvcc compile check, distributed)
# A stage written NAME:SECONDS is stopped after that many seconds (a lease's time is short).
# BENCH_DTYPES (default float32,bfloat16,float16) and MODEL_EXECUTIONS (default eager,compile)
# narrow the bench and models stages.
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
[ ${#STAGES[@]} -eq 0 ] && STAGES=(build gpu-tests variants bench other-tests)
export PYTHONUNBUFFERED=1  # logs stay complete up to the moment a time limit stops the run
# The interpreter that holds torch: $PYTHON, else python, else python3 (some
# machines have only python3). Not a symlink: a venv's python finds its
# packages through the path it was started by.
PY="${PYTHON:-$(command -v python || command -v python3)}"
failed=0

# Tests whose id names CUDA: the "cuda" device cases and tests/cuda/; the nvcc
# compile check (tests/install/test_cuda_build.py) runs no GPU code and goes with the rest.
GPU_TESTS="cuda and not cuda_build"
PYTEST=("$PY" -m pytest -p no:cacheprovider -rs --durations=20 --continue-on-collection-errors)
# pytest-xdist, where installed, runs the GPU tests in 4 processes (the GPU has room; the host
# side of the small cases is the bottleneck).
PARALLEL=()
"$PY" -c 'import xdist' 2>/dev/null && PARALLEL=(-n 4)

LIMIT=0  # seconds the current stage may run, 0: no limit (set from NAME:SECONDS)
run_stage() {  # run_stage NAME COMMAND...: log to $OUT/NAME.log, record status and time
    local name=$1 start=$SECONDS status
    shift
    echo "== $name: $*" | tee -a "$OUT/summary.txt"
    if declare -F "$1" > /dev/null; then  # a function of this script: no timeout(1) around it
        "$@" < /dev/null > "$OUT/$name.log" 2>&1  # nothing waits on a terminal's input
    else
        timeout --kill-after=10 "$LIMIT" "$@" < /dev/null > "$OUT/$name.log" 2>&1
    fi
    status=$?
    echo "   $name: exit $status in $((SECONDS - start)) s" | tee -a "$OUT/summary.txt"
    [ $status -eq 0 ] || { failed=1; tail -n 30 "$OUT/$name.log"; }
    return $status
}

smoke() {
    "$PY" -c 'import torch, torch_bn_grad
y, mean, var = torch_bn_grad.batch_norm_forward(torch.randn(8, 4, 16, device="cuda"))
torch.cuda.synchronize()
print("CUDA forward ok on", torch.cuda.get_device_name(), "- mean", mean.cpu().tolist())'
}

build() {
    if smoke; then echo "the extension in the tree runs on this GPU: not rebuilt"; return 0; fi
    # One architecture (this GPU's) halves the nvcc time; MAX_JOBS uses every core.
    TORCH_CUDA_ARCH_LIST="$("$PY" -c 'import torch; print("%d.%d" % torch.cuda.get_device_capability())')" \
    MAX_JOBS="$(nproc)" "$PY" -m pip install --no-build-isolation --no-deps -v -e . && smoke
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

for spec in "${STAGES[@]}"; do
    stage=${spec%%:*}
    LIMIT=0
    [ "$spec" != "$stage" ] && LIMIT=${spec#*:}
    case $stage in
        build) run_stage build build || break ;;  # nothing else can run without the extension
        gpu-tests) run_stage gpu-tests "${PYTEST[@]}" "${PARALLEL[@]}" -k "$GPU_TESTS" --junitxml="$OUT/gpu-tests.xml" ;;
        variants) run_stage variants "$PY" benchmarks/variants.py --json "$OUT/variants.json" &&
                  run_stage variants-choice "$PY" scripts/choose_variants.py "$OUT/variants.json" \
                      --tests "$OUT/gpu-tests.xml" --json "$OUT/variants_choice.json" ;;
        host-cost) run_stage host-cost "$PY" benchmarks/host_cost.py --json "$OUT/host_cost.json" --trace "$OUT/traces" ;;
        # GPU kernels take microseconds to milliseconds: 0.05 s per measurement is thousands of runs.
        bench) run_stage bench "$PY" -m torch_bn_grad.bench --device cuda --full --min-run-time 0.05 \
                   --dtypes "${BENCH_DTYPES:-float32,bfloat16,float16}" --json "$OUT/bench.json" ;;
        models) run_stage models "$PY" -m torch_bn_grad.bench --device cuda --model resnet50 --fuse \
                    --batch-size 64 --resolution 224 --modes train,eval --layouts channels_last \
                    --executions "${MODEL_EXECUTIONS:-eager,compile}" --json "$OUT/models.json" &&
                run_stage models-bf16 "$PY" -m torch_bn_grad.bench --device cuda --model resnet50 --fuse \
                    --batch-size 64 --resolution 224 --modes train --layouts channels_last \
                    --executions eager --autocast bfloat16 --json "$OUT/models_bf16.json" ;;
        models-graphs) run_stage models-graphs "$PY" -m torch_bn_grad.bench --device cuda --model resnet50 --fuse \
                    --batch-size 64 --resolution 224 --modes train --layouts channels_last \
                    --executions cuda-graph --json "$OUT/models_cuda_graph.json" ;;
        models-reduce-overhead) run_stage models-reduce-overhead "$PY" -m torch_bn_grad.bench --device cuda \
                    --model resnet50 --fuse --batch-size 64 --resolution 224 --modes train --layouts channels_last \
                    --executions reduce-overhead --json "$OUT/models_reduce_overhead.json" ;;
        masked) run_stage masked "$PY" benchmarks/masked.py --device cuda --processes 3 --json "$OUT/masked.json" ;;
        profile) run_stage profile "$PY" benchmarks/profile_model.py --device cuda ;;
        other-tests) run_stage other-tests "${PYTEST[@]}" -k "not ($GPU_TESTS)" --junitxml="$OUT/other-tests.xml" ;;
        *) echo "unknown stage: $stage (build, gpu-tests, variants, host-cost, bench, models, models-graphs," \
                "models-reduce-overhead, masked, profile, other-tests)"; exit 2 ;;
    esac
done
exit $failed
