#!/bin/sh
# `make demo`: fine-tune timm's ResNet-50 (random init, 10 digit classes) with Distributed
# Shampoo on two CPU processes: timm's parameter groups, blocks spread over the two ranks,
# one all-gather per step, Shampoo preconditioning from step 10 (refreshed every 10 steps).
# 2-3 minutes on two cores (60 steps). Extra arguments go to the script, e.g. `--opt adamw`.
# Usage: examples/demo.sh [flags of examples/finetune_timm_resnet50.py]
#        PY=path/to/python NPROC=2 examples/demo.sh
set -eu
cd "$(dirname "$0")/.."
PY="${PY:-.venv/bin/python}"
NPROC="${NPROC:-2}"
# One thread per process: two processes share the two cores.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
# `accelerate launch --cpu --num_processes 2` would start one process; torchrun starts two,
# and Accelerator(cpu=True) inside the script joins them with the gloo backend.
exec "$PY" -m torch.distributed.run --standalone --nproc_per_node "$NPROC" \
    examples/finetune_timm_resnet50.py --model resnet50 --image-size 32 --batch-size 16 \
    --steps 60 --precondition-frequency 10 --start-preconditioning-step 10 --cpu "$@"
