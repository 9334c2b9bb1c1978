#!/usr/bin/env bash
# The GPU measurements of docs/gpu.md in a few long commands, for a machine with one NVIDIA
# GPU and no network (torch, transformers, accelerate, timm, scikit-learn and pytest
# installed; hf_shampoo is used from this checkout through PYTHONPATH, nothing is
# installed). Each part writes its log and tables under $OUT (default ./gpu-results) and is
# cut at its own time limit, so that a part that overruns still leaves the others' results.
#
#   bash benchmarks/gpu_session.sh check      # versions, the GPU, an import (seconds)
#   bash benchmarks/gpu_session.sh tests      # HF_SHAMPOO_TEST_DEVICE=cuda on the device-generic tests
#   bash benchmarks/gpu_session.sh step       # step_time.py --device cuda: ResNet-50, GPT-2 small/medium
#   bash benchmarks/gpu_session.sh e2e        # end_to_end.py: ResNet-50 bf16 and GPT-2 via the Trainer
#                                             # (or e2e-resnet50 / e2e-gpt2: one each, ~5 min)
#   bash benchmarks/gpu_session.sh all        # the four in order
#
# Planned as separate device calls of at most 10 minutes: check + tests, step, e2e-resnet50,
# e2e-gpt2 (each part's time limit below leaves room for the machine's start).
#
# SMOKE=1 DEVICE=cpu runs every part at toy size on a CPU (the plumbing, in about 3 min).
#
# Meta's implementation (facebookresearch/optimizers) is looked for in $META_PATH (default
# ./.meta, ignored by git): copy its `distributed_shampoo` folder there to compare against
# it; without it the Meta rows and the parity tests are skipped, and the log says so.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-results}
META_PATH=${META_PATH:-.meta}
PY=${PYTHON:-python3}
DEVICE=${DEVICE:-cuda}
SMOKE=${SMOKE:-0}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false

meta_args=(--no-meta)
if [ -d "$META_PATH/distributed_shampoo" ]; then
    meta_args=(--meta-path "$META_PATH")
    export HF_SHAMPOO_META_PATH="$PWD/$META_PATH"
else
    echo "no $META_PATH/distributed_shampoo: Meta's rows and parity tests are skipped"
fi

part() {  # part NAME SECONDS COMMAND...: run with a time limit, log to $OUT/NAME.log
    local name=$1 seconds=$2
    shift 2
    echo "== $name ($(date -u +%H:%M:%S), limit ${seconds}s): $*"
    timeout "$seconds" "$@" 2>&1 | tee "$OUT/$name.log"
    local rc=${PIPESTATUS[0]}
    echo "== $name exit $rc"
    return 0
}

check() {
    part check 120 bash -c "nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv;
        $PY -c 'import torch, transformers, accelerate, timm, hf_shampoo;
print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda,
      torch.cuda.get_device_name() if torch.cuda.is_available() else \"no GPU\");
print(\"transformers\", transformers.__version__, \"accelerate\", accelerate.__version__,
      \"timm\", timm.__version__)'"
}

tests() {
    local modules
    modules=$($PY -c 'import sys; sys.argv = ["x"]
from tests.conftest import DEVICE_GENERIC
print(" ".join(f"tests/{m}.py" for m in sorted(DEVICE_GENERIC)))')
    [ "$SMOKE" = 1 ] && modules="tests/test_host_sync.py tests/test_gpu.py tests/test_kronecker.py"
    HF_SHAMPOO_TEST_DEVICE=$DEVICE part tests 280 $PY -m pytest -q -p no:cacheprovider \
        --junitxml="$OUT/tests.xml" $modules
}

step() {
    if [ "$SMOKE" = 1 ]; then
        part step_gpt2_tiny 200 $PY benchmarks/step_time.py --device "$DEVICE" --threads 1 \
            --model gpt2-tiny "${meta_args[@]}" --rounds 2 --steady 2 --soap --qr-tolerance 0 \
            --low-precision-roots \
            --orthogonalization householder cholesky_qr --staggered 3 \
            --write "$OUT/step_gpt2_tiny.md"
        return
    fi
    # fixed-gradient steady/refresh vs Meta and fused AdamW, orthogonalisation per size,
    # staggered vs all over one period of 100 steps, real ResNet-50 runs (staggered max/median)
    part step_resnet50 170 $PY benchmarks/step_time.py --device "$DEVICE" --model resnet50 \
        "${meta_args[@]}" --rounds 3 --steady 10 --qr-tolerance 0 --low-precision-roots \
        --orthogonalization householder cholesky_qr --staggered 100 --real-run 20 \
        --write "$OUT/step_resnet50.md"
    part step_gpt2 150 $PY benchmarks/step_time.py --device "$DEVICE" --model gpt2 \
        "${meta_args[@]}" --rounds 3 --steady 10 --soap --qr-tolerance 0 0.1 \
        --low-precision-roots --staggered 100 --write "$OUT/step_gpt2.md"
    part step_gpt2_medium 180 $PY benchmarks/step_time.py --device "$DEVICE" --model gpt2-medium \
        "${meta_args[@]}" --rounds 2 --steady 10 --low-precision-roots --staggered 100 \
        --write "$OUT/step_gpt2_medium.md"
}

e2e() {  # e2e WORKLOAD SECONDS: AdamW (fused) against Shampoo F=100 staggered, + variants
    local size=()
    [ "$SMOKE" = 1 ] && size=(--tiny)
    part "e2e_$1" "$2" $PY benchmarks/end_to_end.py --device "$DEVICE" "${size[@]}" \
        --workload "$1" --variants qr bf16-roots \
        --json "$OUT/e2e_$1.json" --write "$OUT/e2e_$1.md"
}

case "${1:-all}" in
    check) check ;;
    tests) tests ;;
    step) step ;;
    e2e) e2e resnet50 400; e2e gpt2 300 ;;
    e2e-resnet50) e2e resnet50 540 ;;
    e2e-gpt2) e2e gpt2 540 ;;
    all) check; tests; step; e2e resnet50 400; e2e gpt2 300 ;;
    *) echo "usage: $0 check|tests|step|e2e|e2e-resnet50|e2e-gpt2|all" >&2; exit 2 ;;
esac
