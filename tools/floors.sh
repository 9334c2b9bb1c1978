#!/usr/bin/env bash
# The floor check (`make floors`): the oldest supported releases of torch and of every
# integration's library (tools/floors.txt, the floors of pyproject.toml) and the oldest
# supported Python, in a virtual environment of their own, running the unit layer, the
# integration tests of the libraries at their floors and a small distributed subset (DDP,
# FSDP2 / HSDP, tensor parallel, DCP resumes across meshes). CI tests the newest releases
# (`make test`); this is run by hand when a floor moves or a release nears
# (docs/compatibility.md records what ran).
#
#   tools/floors.sh                         # Python 3.10 (FLOORS_PYTHON), venv .venv-floors
#   FLOORS_VENV=/tmp/floors tools/floors.sh
#
# PyPI's torch for Linux is a CUDA build: the first run downloads a few GB.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# Python 3.10, the oldest supported: python3.10 on the PATH, else pyenv's
PYTHON="${FLOORS_PYTHON:-}"
if [ -z "$PYTHON" ]; then
    for candidate in python3.10 "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.10*/bin/python; do
        if "$candidate" -c "" 2>/dev/null; then PYTHON="$candidate"; break; fi
    done
fi
[ -n "$PYTHON" ] || { echo "floors: no python3.10 (set FLOORS_PYTHON)" >&2; exit 1; }
VENV="${FLOORS_VENV:-.venv-floors}"
PY="$VENV/bin/python"
export OMP_NUM_THREADS=1 DS_ACCELERATOR=cpu HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

if [ ! -x "$PY" ]; then
    "$PYTHON" -m venv "$VENV"
fi
# deepspeed is an sdist whose build imports torch: everything else first, then deepspeed
# built against that torch (no isolation), no ops compiled ahead
grep -v '^deepspeed' tools/floors.txt > "$VENV/floors-first.txt"
"$PY" -m pip install -q -r "$VENV/floors-first.txt"
"$PY" -m pip install -q --no-build-isolation "$(grep '^deepspeed==' tools/floors.txt)"
"$PY" - <<'PYTHON'
import importlib.metadata as m
import sys
names = ("torch", "torchvision", "transformers", "accelerate", "timm", "peft", "deepspeed")
print("floor check: Python", sys.version.split()[0], "|",
      ", ".join(f"{n} {m.version(n)}" for n in names))
PYTHON

# this checkout, not an installed copy
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
run() { echo "+ pytest $*"; "$PY" -m pytest -q -p no:cacheprovider "$@"; }
run -m unit
run -m "not slow" tests/test_integration_transformers.py tests/test_integration_accelerate.py \
    tests/test_integration_timm.py tests/test_integration_modules.py tests/test_peft.py \
    tests/test_riemannian_lora.py tests/test_deepspeed.py
# one spawn per world runs every scenario of a module: these ids cost its spawns once
run tests/test_distributed.py tests/test_sharded.py tests/test_parallel.py \
    -k "bit_identical_to_one_process or resumes"
echo "floor check passed"
