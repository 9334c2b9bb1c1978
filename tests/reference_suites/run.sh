#!/usr/bin/env bash
# Run timm's and torch's own optimizer test files against hf_shampoo, from copies outside
# the repository (they are others' code: run, never vendored). See README.md here; `make
# reference-suites` (part of `make test`, hence CI) runs both.
#
#   tests/reference_suites/run.sh timm [WORKDIR]
#       downloads the sdist of the installed timm into WORKDIR (default: a temporary
#       directory, removed after) and runs its tests/test_optim.py for the names
#       hf_shampoo registers
#   tests/reference_suites/run.sh torch PYTORCH_TEST_DIR
#       runs TestOptimRenewed of PYTORCH_TEST_DIR/test_optim.py (the test/ directory of a
#       pytorch checkout at the installed torch's version tag) for DistributedShampoo
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PY="${PY:-$ROOT/.venv/bin/python}"
export PYTHONPATH="$ROOT/tests/reference_suites${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
suite="${1:-}"
case "$suite" in
  timm)
    if [ -n "${2:-}" ]; then
      work="$2"
    else  # a temporary directory, removed on exit
      work="$(mktemp -d)"
      trap 'rm -rf "$work"' EXIT
    fi
    version="$("$PY" -c 'import timm; print(timm.__version__)')"
    "$PY" -m pip download "timm==$version" --no-deps --no-binary :all: -d "$work" -q
    tar xzf "$work/timm-$version.tar.gz" -C "$work"
    cd "$work/timm-$version"
    "$PY" -m pytest -p hf_shampoo_suites -p no:cacheprovider -q \
      tests/test_optim.py -k "shampoo or soap or klshampoo" "${@:3}"
    ;;
  torch)
    dir="${2:?give the test/ directory of a pytorch checkout at the installed version}"
    cd "$dir"
    "$PY" -m pytest -p hf_shampoo_suites -p no:cacheprovider -q \
      test_optim.py -k "TestOptimRenewed and DistributedShampoo" "${@:3}"
    ;;
  *)
    echo "usage: $0 timm [WORKDIR] | torch PYTORCH_TEST_DIR" >&2
    exit 2
    ;;
esac
