# Set-up-free entry points: `make demo`, `make test`. Everything runs from .venv.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: venv test test-other-blas test-emulated-epyc test-fast reference-suites fuzz floors demo demo-digits lint clean

venv: $(STAMP)

$(PY):
	$(PYTHON) -m venv $(VENV)

# Re-install whenever pyproject.toml changes: `.[dev]` is every extra (what the examples,
# the benchmarks and the tests use) and the test tools.
$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install -e '.[dev]'
	touch $@

# Our suite, then torch's and timm's own optimizer suites: a failure in any fails the run.
test: venv
	$(PY) -m pytest -q --durations=15
	@$(MAKE) --no-print-directory reference-suites

# torch's TestOptimRenewed and timm's tests/test_optim.py, run against hf_shampoo from
# copies outside the repository (tests/reference_suites/README.md). torch's test file is
# not in its wheel: it is looked for next to the clone, as CI places it.
TORCH_OPTIM_TESTS ?= ../shared/pytorch-test-optim
reference-suites: venv
	@if [ -d "$(TORCH_OPTIM_TESTS)" ]; then \
	    echo "torch's optimizer suite from $(TORCH_OPTIM_TESTS)"; \
	    PY="$(abspath $(PY))" tests/reference_suites/run.sh torch "$(TORCH_OPTIM_TESTS)"; \
	else \
	    echo "no $(TORCH_OPTIM_TESTS): torch's own optimizer suite is skipped" \
	         "(its test/test_optim.py is not in the wheel; tests/reference_suites/README.md)"; \
	fi
	PY="$(abspath $(PY))" tests/reference_suites/run.sh timm

# Our suite again on other kernels of the same BLAS (MKL's SSE4.2 code path), which batch a
# product differently from the default ones, as another CPU's library does: bit identity
# must not depend on which runs (docs/design.md §13). Before the stacking rule this failed
# the four stack tests an AMD EPYC failed; on a torch without MKL it changes nothing.
test-other-blas: venv
	MKL_ENABLE_INSTRUCTIONS=SSE4_2 $(PY) -m pytest -q

# The tests that compare bits across stacks, layouts and processes, run as on an AMD EPYC:
# Python under qemu's user-mode emulator with an EPYC's CPUID, so that MKL and ATen take the
# kernels they take on that CPU, in every process a test starts (benchmarks/emulated_cpu.py).
# Needs Debian's qemu-user (apt-get install qemu-user); about 30 min on 2 cores.
EPYC_PYTHON := .emulated-epyc/bin/python
BIT_TESTS := tests/test_kronecker.py tests/test_sketchy.py tests/test_simulated_ranks.py \
	tests/test_generated_layouts.py tests/test_generated_dp_layouts.py tests/test_compile.py
test-emulated-epyc: venv
	$(PY) -m benchmarks.emulated_cpu .emulated-epyc
	$(EPYC_PYTHON) -m pytest -q $(BIT_TESTS)
	$(EPYC_PYTHON) -m pytest -q tests/test_benchmarks.py -k "batch_invariance or other_kernels"

test-fast: venv
	$(PY) -m pytest -q -m "not slow"

# The generated layout cases at scale: HF_SHAMPOO_LAYOUT_CASES times the cases of each seed,
# HF_SHAMPOO_LAYOUT_FRESH fresh seeds besides the fixed one (override either:
# `make fuzz HF_SHAMPOO_LAYOUT_CASES=5`); a generated file not in this checkout is skipped.
HF_SHAMPOO_LAYOUT_CASES ?= 20
HF_SHAMPOO_LAYOUT_FRESH ?= 5
FUZZ_FILES := $(wildcard tests/test_generated_dp_layouts.py tests/test_generated_layouts.py)
fuzz: venv
	HF_SHAMPOO_LAYOUT_CASES=$(HF_SHAMPOO_LAYOUT_CASES) HF_SHAMPOO_LAYOUT_FRESH=$(HF_SHAMPOO_LAYOUT_FRESH) \
		$(PY) -m pytest -q $(FUZZ_FILES)

# The oldest supported releases (tools/floors.txt) in their own venv (.venv-floors, Python
# 3.10): the unit layer, the integrations' tests and a small distributed subset
# (docs/compatibility.md). CI tests the newest releases; this is run by hand when a floor
# moves.
floors:
	tools/floors.sh

# ResNet-50 fine-tune on 2 CPU processes (torchrun + Accelerate), a few minutes.
demo: venv
	PY=$(PY) sh examples/demo.sh

# The single-process MLP on scikit-learn's digits, under a minute.
demo-digits: venv
	$(PY) examples/train_digits.py

lint: venv
	$(PY) -m ruff check .

clean:
	rm -rf build dist *.egg-info .pytest_cache .ruff_cache outputs
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -exec rm -rf {} +
