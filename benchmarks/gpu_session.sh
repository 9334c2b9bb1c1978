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
#   bash benchmarks/gpu_session.sh tp         # Accelerate's ParallelismConfig (TP x FSDP2) with
#                                             # hf_shampoo, stage by stage, on every GPU (~1 min)
#   bash benchmarks/gpu_session.sh all        # the four in order
#   bash benchmarks/gpu_session.sh lent       # ONE call of at most 9 minutes, the most valuable
#                                             # first (below): what a lent 15-minute GPU runs
#   bash benchmarks/gpu_session.sh followup   # after `lent`, in what is left (~5 min): the
#                                             # device tests again, batch invariance, roots
#
# `lent` runs check, the `device` tests (SIGINT after 140 s, so pytest prints its summary),
# Muon, the step against Meta, the root solvers and GPT-2 through the Trainer, each cut at
# its own limit (540 s in all; docs/gpu.md). `step` and `e2e` fit a 10-minute call each.
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

part() {  # part NAME SECONDS COMMAND...: run with a time limit, append to $OUT/NAME.log
    local name=$1 seconds=$2
    shift 2
    echo "== $name ($(date -u +%H:%M:%S), limit ${seconds}s): $*" | tee -a "$OUT/$name.log"
    timeout "$seconds" "$@" 2>&1 | tee -a "$OUT/$name.log"
    local rc=${PIPESTATUS[0]}
    echo "== $name exit $rc"
    return 0
}

check() {  # check [SECONDS]
    part check "${1:-120}" bash -c "nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv;
        $PY -c 'import torch, transformers, accelerate, timm, hf_shampoo;
print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda,
      torch.cuda.get_device_name() if torch.cuda.is_available() else \"no GPU\");
print(\"transformers\", transformers.__version__, \"accelerate\", accelerate.__version__,
      \"timm\", timm.__version__)'"
}

tests() {
    # the modules marked `device` (tests/conftest.py)
    local modules=tests
    [ "$SMOKE" = 1 ] && modules="tests/test_host_sync.py tests/test_gpu.py tests/test_kronecker.py"
    HF_SHAMPOO_TEST_DEVICE=$DEVICE part tests 240 $PY -m pytest -q -p no:cacheprovider \
        -m device --junitxml="$OUT/tests.xml" $modules
}

lent() {
    # GPT-2 end to end with every GPU-oriented row (the Trainer's default refresh_delay=1
    # and Meta's 0, one stack per kind for Shampoo and Muon, TF32 products); ResNet-50's
    # step and the roots moved to followup to make room
    local scale=() e2e_size=(--frequency 100 --warmup 100 --refresh-delay 0
                             --variants fused tf32)
    local muon_size=(--layers 12 --width 768)
    local models=(gpt2)
    if [ "$SMOKE" = 1 ]; then
        scale=(--steady 2 --threads 1) e2e_size=(--tiny --refresh-delay 0 --variants fused tf32)
        muon_size=(--layers 1 --width 64)
        models=(gpt2-tiny)
    fi
    check 45
    # the simulated ranks first: one process and each rank's stacks on the GPU, bit for bit
    local modules="tests/test_simulated_ranks.py tests/test_refresh_delay.py tests"
    [ "$SMOKE" = 1 ] && modules="tests/test_host_sync.py tests/test_kronecker.py"
    echo "== tests (SIGINT after 120 s: pytest prints its summary)" | tee -a "$OUT/tests.log"
    HF_SHAMPOO_TEST_DEVICE=$DEVICE timeout -s INT 120 $PY -m pytest -q -p no:cacheprovider \
        -m device --junitxml="$OUT/tests.xml" $modules 2>&1 | tail -n 40 | tee -a "$OUT/tests.log"
    part muon 35 $PY -m benchmarks.muon_step_time --device "$DEVICE" --worlds 1 --rounds 5 \
        "${muon_size[@]}"
    local model
    for model in "${models[@]}"; do
        part "step_$model" 65 $PY -m benchmarks.step_time --device "$DEVICE" --model "$model" \
            "${meta_args[@]}" --rounds 1 --steady 5 --low-precision-roots "${scale[@]}"
    done
    part e2e_gpt2 275 $PY -m benchmarks.end_to_end --device "$DEVICE" --workload gpt2 --muon \
        "${e2e_size[@]}" --json "$OUT/e2e_gpt2.json" --write "$OUT/e2e_gpt2.md"
}

followup() {  # the second call of a lent GPU: tests after fixes, what `lent` cut short
    local modules="tests/test_simulated_ranks.py tests/test_refresh_delay.py tests"
    local roots=(--model resnet50 --rounds 1)
    if [ "$SMOKE" = 1 ]; then
        modules="tests/test_host_sync.py tests/test_kronecker.py"
        roots=(--model gpt2-tiny --rounds 1 --threads 1)
    fi
    echo "== tests (SIGINT after 150 s: pytest prints its summary)" | tee -a "$OUT/tests.log"
    HF_SHAMPOO_TEST_DEVICE=$DEVICE timeout -s INT 150 $PY -m pytest -q -p no:cacheprovider \
        -m device --junitxml="$OUT/tests.xml" $modules 2>&1 | tail -n 40 | tee -a "$OUT/tests.log"
    local dtypes=(--dtypes float32 float64)
    [ "$SMOKE" = 1 ] && dtypes=(--dtypes float64)
    part batch_invariance 50 $PY -m benchmarks.batch_invariance --device "$DEVICE" "${dtypes[@]}"
    local resnet=(--steady 5 --rounds 1)
    [ "$SMOKE" = 1 ] && resnet=(--steady 2 --threads 1)
    part step_resnet50 65 $PY -m benchmarks.step_time --device "$DEVICE" --model resnet50 \
        "${meta_args[@]}" "${resnet[@]}" --low-precision-roots
    part step_roots 80 $PY -m benchmarks.root_solvers --device "$DEVICE" "${roots[@]}"
}

step() {
    # per model, into one log: the steady step, eigh and QR refreshes (Householder and
    # Cholesky-QR, with the per-size cost table) and bf16 roots against Meta and fused AdamW;
    # then "all" against "staggered" over one period of F = 100 steps
    local models=(resnet50 gpt2 gpt2-medium) f=100 model
    [ "$SMOKE" = 1 ] && models=(gpt2-tiny) && f=3
    for model in "${models[@]}"; do
        local sizes=(--rounds 2 --steady 10 --qr-tolerance 0
                     --orthogonalization householder cholesky_qr) limit=150
        [ "$model" = resnet50 ] && limit=120
        [ "$model" = gpt2-medium ] && sizes=(--rounds 1 --steady 10 --qr-tolerance 0)
        [ "$SMOKE" = 1 ] && sizes+=(--steady 2 --threads 1)
        part "step_$model" $limit $PY -m benchmarks.step_time --device "$DEVICE" \
            --model "$model" "${meta_args[@]}" "${sizes[@]}" --low-precision-roots
        part "step_$model" 60 $PY -m benchmarks.step_time --device "$DEVICE" \
            --model "$model" --only-staggered --staggered $f
    done
    # inverse roots by eigh against the coupled iterations, ResNet-50's factors
    local roots=(--model resnet50 --rounds 3)
    [ "$SMOKE" = 1 ] && roots=(--model gpt2-tiny --rounds 1 --threads 1)
    part "step_roots" 60 $PY -m benchmarks.root_solvers --device "$DEVICE" "${roots[@]}"
}

e2e() {  # e2e WORKLOAD SECONDS: AdamW (fused) against Shampoo F=100 staggered, + variants
    local size=()
    [ "$SMOKE" = 1 ] && size=(--tiny)
    part "e2e_$1" "$2" $PY -m benchmarks.end_to_end --device "$DEVICE" "${size[@]}" \
        --workload "$1" --variants qr bf16-roots \
        --json "$OUT/e2e_$1.json" --write "$OUT/e2e_$1.md"
}

tp() {  # Accelerate's ND-parallel path on all GPUs (tensor parallel 2 where there are 2)
    local gpus=1
    if [ "$DEVICE" = cuda ]; then
        gpus=$($PY -c 'import torch; print(max(torch.cuda.device_count(), 1))')
    else
        gpus=2
    fi
    local opt
    for opt in shampoo muon; do
        part tp 120 $PY -m torch.distributed.run --standalone --nproc_per_node "$gpus" \
            -m benchmarks.accelerate_tp --tp-size 2 --device "$DEVICE" --optimizer "$opt"
    done
}

case "${1:-all}" in
    check) check ;;
    tests) tests ;;
    step) step ;;
    e2e) e2e resnet50 300; e2e gpt2 240 ;;
    e2e-resnet50) e2e resnet50 540 ;;
    e2e-gpt2) e2e gpt2 540 ;;
    tp) tp ;;
    lent) lent ;;
    followup) followup ;;
    all) check; tests; step; e2e resnet50 300; e2e gpt2 240 ;;
    *) echo "usage: $0 check|tests|step|e2e|e2e-resnet50|e2e-gpt2|tp|lent|followup|all" >&2; exit 2 ;;
esac
