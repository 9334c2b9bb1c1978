"""The benchmark scripts at toy size (``benchmarks/``), one module for all of them.

``test_toy_run`` is the common shape: run ``python -m benchmarks.<name>`` at toy size and
check what it prints with the case's own check, which asserts the properties of that
benchmark's tables (complete, made of measured and finite numbers, the counts or the
equalities it reports; timings are printed, never compared with each other):

- ``step_time``: every table, on the device the suite runs on (``--device``), each schedule's
  ratio within what its rounded times allow;
- ``muon_step_time``: one process and two gloo ranks print a row each, and in every row ours
  and ``torch.optim.Muon`` computed the same parameters (bfloat16 rounding);
- ``pass_budget``: every kind prints its table, the non-finite check reads every gradient once
  and writes nothing, the parameters are read and written by one ``add_``, and the gradients
  are stacked by one copy (the step never makes them views of its stacks);
- ``refresh_delay``: a row per setting ("all" and staggered without a delay, "all" with
  d = f/2 and d = f), each with a median and a slowest step;
- ``sketchy_step_time``: a row for Shampoo and one per rank and statistics frequency.

The tests that do not fit that shape follow, per benchmark:

- ``end_to_end.py`` (``--tiny``): the runs it times are the ones it claims (a window of
  exactly F steps after every Shampoo block has preconditioned, the Trainer's optimizer built
  from the ``optim_args`` string, the same initialisation and first batch for every
  optimizer), and ``--write`` replaces its section in place; one run shared by its tests;
- ``batch_invariance.py`` reports, per operation, whether a block gets the same bits in a
  stack of 8 as alone: what the library at hand does, which differs between CPUs (an Intel
  Xeon said yes everywhere at one thread, an AMD EPYC did not for the row-form matvec at 130)
  and between thread counts and devices. Nothing rests on it (docs/design.md §4: stacks are
  cut by a rule of the blocks alone), so the tests assert the report, not the library: a row
  for every operation, size and dtype, and a **no** wherever the products round by batch
  (``tests/batch_variant.py``);
- ``quantization_accuracy.py``'s float32-storage mode (``LosslessStorage``), on which the
  4-bit accuracy analysis rests: inside it, 4-bit Shampoo runs its own algorithm (samples,
  decompositions, roots) with float32 numbers, so that sampling every step gives 32-bit
  Shampoo back, and so does the default warm-up up to the first refresh; outside it nothing
  is changed;
- ``sketchy_step_time.py``'s mean step over a refresh period is built from the measured steps
  (``mean_step``);
- ``step_time.py`` refuses a bad ``--device`` before anything is built;
- ``other_kernels.py``: on every set of kernels it runs (the default ones and MKL's other
  code paths, ``make test-other-blas``), a vector of 31 elements ends bit for bit the same
  beside a second one as alone (on MKL's SSE4.2 path it moved by 1.1e-4 before the stacking
  rule); on a torch without MKL every row runs the default kernels. Where qemu-x86_64 is
  installed (CI installs it), also as on an AMD EPYC (``emulated_cpu.py``): the case runs with
  MKL on the code path it takes on that CPU (on an Intel CPU its banner names another path
  than this CPU's, checked), and vectors of 17 and 31 elements do not move (before the
  stacking rule they moved by 3.0e-2 and 1.4e-2 there, as on the real EPYC by 3.2e-2 and
  8.1e-3).
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch

from benchmarks import batch_invariance, emulated_cpu, end_to_end, other_kernels
from benchmarks.quantization_accuracy import LosslessStorage
from benchmarks.sketchy_step_time import mean_step
from hf_shampoo import DistributedShampoo, quantization
from hf_shampoo.preconditioners.quantized import QuantizedFactors
from tests import helpers
from tests.batch_variant import BatchVariantProducts
from tests.helpers import ROOT, TEST_DEVICE, torch_threads

pytestmark = pytest.mark.benchmarks


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip("|").split("|")]


def _rows(text: str, first_cell: str) -> list[list[str]]:
    return [_cells(line) for line in text.splitlines() if line.startswith(f"| {first_cell}")]


# ---------------------------------------------------------------- the toy runs' checks


def check_step_time(out: str) -> None:
    (ours,) = _rows(out, "hf_shampoo |")
    steady, refresh, second = (float(x) for x in ours[1:4])
    assert 0 < steady and 0 < refresh and math.isfinite(second)  # (no order: load varies)
    assert _rows(out, "torch.optim.AdamW (fused)")
    floor = re.search(r"refresh floor .*?: ([\d.]+) \+ ([\d.]+) = ([\d.]+) s", out)
    assert floor and float(floor.group(1)) > 0
    schedules = {row[0]: row for row in _rows(out, "all") + _rows(out, "staggered")}
    assert set(schedules) == {"all", "staggered"}
    for row in schedules.values():
        median_step, slowest, ratio, mean = (float(x) for x in row[1:5])
        assert 0 < median_step <= slowest and 0 < mean <= slowest
        # The printed ratio (one decimal) is of the unrounded times, the times are printed
        # to four decimals: the ratio must lie in what the rounded times allow.
        half = 5e-5
        low = (slowest - half) / (median_step + half) - 0.05
        high = (slowest + half) / max(median_step - half, 1e-12) + 0.05
        assert low <= ratio <= high, (ratio, slowest, median_step)
    assert "steps 6-8 timed" in out


def check_muon_step_time(out: str) -> None:
    rows = [line for line in out.splitlines() if re.match(r"\| [12] \|", line)]
    assert len(rows) == 2, out
    for row in rows:
        cells = _cells(row)
        assert cells[1] == "4"  # the hidden matrices of one layer
        assert float(cells[-1]) < 1e-2  # same numbers as torch.optim.Muon
    assert rows[1].split("|")[3].strip() in ("2/2", "3/1", "1/3")  # matrices split


def check_pass_budget(out: str) -> None:
    for kind in ("shampoo", "soap", "muon", "diagonal"):
        assert f"**{kind}**" in out, out
    rows = re.findall(r"^\| (\w[\w ]*) \| ([\w ]+) \| `(\w+)` \| (\d+) \| ([\d.]+) \| ([\d.]+) \|",
                      out, flags=re.M)
    check = [r for r in rows if r[0] == "check"]
    assert len(check) == 4 and all(float(r[4]) == 1.0 and float(r[5]) == 0.0
                                   for r in check), check
    applied = [r for r in rows if r[0] == "apply"]
    assert len(applied) == 4 and all(r[2] == "add_" and float(r[4]) == 2.0
                                     and float(r[5]) == 1.0 for r in applied), applied
    gathered = [r for r in rows if r[0] == "gather"]
    assert len(gathered) == 4 and all(float(r[4]) == 1.0 and float(r[5]) == 1.0
                                      for r in gathered), gathered


def check_refresh_delay(out: str) -> None:
    rows = [line for line in out.splitlines() if re.match(r"\| (all|staggered) \|", line)]
    assert [tuple(_cells(r)[:2]) for r in rows] == [
        ("all", "0"), ("staggered", "0"), ("all", "2"), ("all", "4")], out
    for row in rows:
        median, slowest = (float(c) for c in _cells(row)[2:4])
        assert 0 < median <= slowest


def check_sketchy_step_time(out: str) -> None:
    rows = [line for line in out.splitlines() if re.match(r"\| (Shampoo|Sketchy)", line)]
    assert [r.split("|")[1].strip() for r in rows] == [
        "Shampoo", "Sketchy, rank 4", "Sketchy, rank 4, statistics every 5"]
    assert rows[0].split("|")[-2].strip() == "1.00×"
    assert rows[2].split("|")[3].strip() != "–"  # steps without a sample were timed


@dataclass(frozen=True)
class ToyRun:
    """``python -m benchmarks.<module> *args`` at toy size, and the check of its output."""

    module: str
    args: tuple[str, ...]
    check: Callable[[str], None]
    timeout: float = 180


TOY_RUNS = [
    pytest.param(ToyRun("step_time", ("--model", "gpt2-tiny", "--device", str(TEST_DEVICE),
                                      "--threads", "1", "--rounds", "2", "--steady", "1",
                                      "--no-meta", "--staggered", "3"), check_step_time, 300),
                 marks=pytest.mark.device, id="step_time"),
    pytest.param(ToyRun("muon_step_time", ("--worlds", "1", "2", "--rounds", "2", "--warmup",
                                           "0", "--layers", "1", "--width", "32"),
                        check_muon_step_time),
                 marks=pytest.mark.skipif(not hasattr(torch.optim, "Muon"),
                                          reason="torch.optim.Muon needs torch 2.9+"),
                 id="muon_step_time"),
    pytest.param(ToyRun("pass_budget", ("--layers", "1", "--width", "16"), check_pass_budget),
                 id="pass_budget"),
    pytest.param(ToyRun("refresh_delay", ("--steps", "4", "--width", "16", "--batch", "8",
                                          "--frequency", "4"), check_refresh_delay),
                 id="refresh_delay"),
    pytest.param(ToyRun("sketchy_step_time", ("--ranks", "4", "--every", "1", "5", "--rounds",
                                              "1", "--steady", "1"), check_sketchy_step_time),
                 id="sketchy_step_time"),
]


@pytest.mark.parametrize("case", TOY_RUNS)
def test_toy_run(case: ToyRun):
    """The benchmark runs at toy size (one thread) and its tables pass its check."""
    case.check(helpers.run([sys.executable, "-m", f"benchmarks.{case.module}", *case.args],
                           timeout=case.timeout))


# ---------------------------------------------------------------- step_time.py


@pytest.mark.device
@pytest.mark.parametrize("device, message", [("tpu", "expected cpu, cuda or cuda:N")])
def test_step_time_refuses_a_bad_device(device, message):
    done = subprocess.run([sys.executable, "-m", "benchmarks.step_time", "--device", device],
                          cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2
    assert f"--device {device!r}: {message}" in done.stderr


# ---------------------------------------------------------------- end_to_end.py

F, WARMUP = 4, 9  # --tiny: precondition_frequency 4, warm-up 2F + 1
OPTIMIZERS = {
    "resnet50": ["AdamW (fused)", "Shampoo staggered, F=4", "Shampoo all, F=4"],
    "gpt2": ["AdamW (adamw_torch_fused)", "Shampoo staggered, F=4"],
}
OTHER = "# Results\n\nText before.\n\n{section}\n## Later\n\nText after.\n"


def run_end_to_end(*args: str) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-m", "benchmarks.end_to_end", "--tiny", "--device",
                           "cpu", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def end_to_end_rows(text: str) -> list[list[str]]:
    return [_cells(line) for line in text.splitlines()
            if line.startswith(("| resnet50 |", "| gpt2 |"))]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """One ``--tiny`` run of both workloads, its JSON and a markdown file it wrote into."""
    tmp = tmp_path_factory.mktemp("e2e")
    markdown = tmp / "results.md"
    stale = f"{end_to_end.MARK_BEGIN}\nstale table\n{end_to_end.MARK_END}\n"
    markdown.write_text(OTHER.format(section=stale))
    stdout = run_end_to_end("--json", str(tmp / "e2e.json"), "--write", str(markdown))
    return stdout, json.loads((tmp / "e2e.json").read_text()), markdown


def test_end_to_end_table_has_one_row_per_optimizer_and_workload(tiny):
    stdout, saved, _ = tiny
    rows = end_to_end_rows(stdout)
    assert [(r[0], r[1]) for r in rows] == [(w, o) for w, names in OPTIMIZERS.items()
                                            for o in names]
    runs = {(r["workload"], r["optimizer"]): r for r in saved["runs"]}
    for row in rows:
        mean, median, largest = (float(x) for x in row[2:5])
        assert 0 < median <= largest and 0 < mean <= largest
        run = runs[row[0], row[1]]
        assert mean == pytest.approx(run["mean"], abs=1e-4)
        adamw = runs[row[0], OPTIMIZERS[row[0]][0]]["mean"]
        assert float(row[6].rstrip("×")) == pytest.approx(run["mean"] / adamw, abs=0.01)
        assert float(row[7]) == pytest.approx(run["optimizer_mean"], abs=1e-4)
        assert row[8] == "–"  # no GPU memory on CPU
    assert f"Window: steps {WARMUP + 1}–{WARMUP + F}" in stdout
    assert stdout.count("goal ≤ 1.10×") == 2


def test_end_to_end_json_has_the_window_and_same_start_for_every_optimizer(tiny):
    _, saved, _ = tiny
    assert saved["config"]["frequency"] == F and saved["config"]["warmup"] == WARMUP
    assert saved["device_name"] == "cpu" and saved["torch"] and saved["complete"]
    assert [(r["workload"], r["optimizer"]) for r in saved["runs"]] == \
        [(w, o) for w, names in OPTIMIZERS.items() for o in names]
    for run in saved["runs"]:
        assert len(run["times"]) == F and len(run["warmup_times"]) == WARMUP
        assert all(math.isfinite(t) and t > 0 for t in run["times"] + run["warmup_times"])
        assert run["mean"] == pytest.approx(sum(run["times"]) / F)
        assert run["max"] == max(run["times"])
        # the optimizer step is a part of each step (the Trainer's: between its callbacks)
        assert len(run["optimizer_times"]) == F
        assert all(0 < o < t for o, t in zip(run["optimizer_times"], run["times"]))
        assert math.isfinite(run["first_loss"])
    for workload in OPTIMIZERS:
        runs = [r for r in saved["runs"] if r["workload"] == workload]
        # same initialisation, same first batch: one loss before any update
        assert len({round(r["first_loss"], 5) for r in runs}) == 1
        assert runs[0]["optimizer_class"] == "AdamW" and runs[0]["fused"]


def test_end_to_end_shampoo_preconditioned_every_block_before_the_window(tiny):
    _, saved, _ = tiny
    shampoo = [r for r in saved["runs"] if r["optimizer"].startswith("Shampoo")]
    assert len(shampoo) == 3
    for run in shampoo:
        schedule = run["optimizer"].split()[1].rstrip(",")
        start, end = run["shampoo_at_window_start"], run["shampoo_at_end"]
        assert start["class"] == "DistributedShampoo"
        assert start["step"] == [WARMUP] and end["step"] == [WARMUP + F]
        assert start["start_preconditioning_step"] == [F]
        assert start["refresh_schedule"] == [schedule]
        # every block's inverse root differs from its initial identity: all refreshed
        assert start["blocks_with_roots"] > 0
        assert start["blocks_refreshed"] == start["blocks_with_roots"]
        assert end["blocks_refreshed"] == end["blocks_with_roots"]
        assert start["distinct_refresh_offsets"] == (F if schedule == "staggered" else 1)
    # (which step of the window is the slowest is left unasserted: on a busy machine any
    # step can be, and no test may depend on the machine's load)


def test_end_to_end_trainer_optimizer_got_the_optim_args(tiny):
    _, saved, _ = tiny
    run = next(r for r in saved["runs"] if r["workload"] == "gpt2"
               and r["optimizer"].startswith("Shampoo"))
    assert run["optim_args"] == ("precondition_frequency=4,refresh_schedule=staggered,"
                                 "max_preconditioner_dim=1024")
    facts = run["shampoo_at_end"]
    assert facts["class"] == "DistributedShampoo"
    assert facts["precondition_frequency"] == [F]  # the Trainer's default would be 50
    assert facts["refresh_schedule"] == ["staggered"]
    assert facts["max_preconditioner_dim"] == [1024]  # the Trainer's default would be 512
    assert math.isfinite(run["train_loss"])


def test_end_to_end_write_replaces_its_section_in_place(tiny, tmp_path):
    stdout, _, markdown = tiny
    table = stdout.strip()
    assert markdown.read_text() == OTHER.format(
        section=f"{end_to_end.MARK_BEGIN}\n{table}\n{end_to_end.MARK_END}\n")
    # a second run (GPT-2 only) replaces the section again: once, other text kept
    second = run_end_to_end("--workload", "gpt2", "--write", str(markdown)).strip()
    text = markdown.read_text()
    assert text == OTHER.format(
        section=f"{end_to_end.MARK_BEGIN}\n{second}\n{end_to_end.MARK_END}\n")
    assert text.count(end_to_end.MARK_BEGIN) == text.count(end_to_end.MARK_END) == 1
    assert [r[0] for r in end_to_end_rows(text)] == ["gpt2", "gpt2"]
    # a file without the markers gets the section appended
    plain = tmp_path / "plain.md"
    plain.write_text("# Other\n")
    markers = end_to_end.MARK_BEGIN, end_to_end.MARK_END
    end_to_end.write_section(str(plain), "table", *markers)
    end_to_end.write_section(str(plain), "table 2", *markers)
    assert plain.read_text() == (f"# Other\n\n{end_to_end.MARK_BEGIN}\ntable 2\n"
                                 f"{end_to_end.MARK_END}\n")


def test_end_to_end_refuses_a_bad_workload_with_the_valid_values(capsys):
    with pytest.raises(SystemExit) as error:
        end_to_end.parse(["--workload", "vit"])
    assert error.value.code == 2
    message = capsys.readouterr().err
    assert "invalid choice: 'vit'" in message
    assert "'resnet50'" in message and "'gpt2'" in message


# ---------------------------------------------------------------- batch_invariance.py

PRODUCTS = ("factor update (syrk)", "preconditioning (bmm)", "matvec (row form)")


def test_batch_invariance_a_row_per_operation_size_and_dtype(capsys):
    with torch_threads(1):
        rows = batch_invariance.rows("cpu", ["float32", "float64"], sizes=(16, 40, 130))
        batch_invariance.main(["--device", "cpu", "--dtypes", "float64", "--sizes", "16"])
    assert len(rows) == 2 * 3 * 6
    assert {r[0] for r in rows} == {*PRODUCTS, "eigh", "qr basis (householder)", "cholesky"}
    table = capsys.readouterr().out
    assert "thread(s)" in table and table.count("\n| ") == 1 + 6


def test_batch_invariance_products_that_round_by_batch_are_reported():
    with torch_threads(1), BatchVariantProducts():
        rows = batch_invariance.rows("cpu", ["float32"], sizes=(16, 40))
    reported = {(r[0], r[1]): r[3] for r in rows}
    for name in PRODUCTS:
        assert not any(equal for (op, _), equal in reported.items() if op == name), name


# ---------------------------------------------------------------- quantization_accuracy.py


def _train(steps: int = 30, **options) -> torch.Tensor:
    torch.manual_seed(0)
    param = torch.nn.Parameter(torch.randn(128, 96))
    opt = DistributedShampoo([param], lr=1e-2, epsilon=1e-6, precondition_frequency=5,
                             grafting="adam", **options)
    g = torch.Generator().manual_seed(1)
    mixing = torch.randn(128, 128, generator=g) / 10
    for _ in range(steps):
        param.grad = mixing @ torch.randn(128, 96, generator=g) + 0.1 * param.detach()
        opt.step()
    return param.detach().clone()


def test_float32_storage_with_a_sample_every_step_is_32bit_shampoo():
    shampoo = _train()
    every_step = dict(quantization="4bit", statistics_frequency=1)
    four_bit = _train(**every_step)
    with LosslessStorage():
        lossless = _train(**every_step)
    scale = shampoo.norm()
    assert (lossless - shampoo).norm() / scale < 1e-5
    # the 4-bit numbers are what separates the plain 4-bit run from 32 bits
    assert (four_bit - shampoo).norm() / scale > 1e-3


def test_float32_storage_changes_nothing_outside_it():
    saved = quantization.load, quantization.store, QuantizedFactors.eigenvectors
    before = _train(quantization="4bit")
    with LosslessStorage():
        assert quantization.load is not saved[0]
    assert (quantization.load, quantization.store, QuantizedFactors.eigenvectors) == saved
    assert torch.equal(_train(quantization="4bit"), before)


def test_float32_storage_with_the_default_warmup_is_32bit_shampoo_until_samples_thin():
    """precondition_frequency=5: steps 1-5 take every gradient, the roots of step 5 serve
    steps 6-9 (as in 32 bits), the sample at step 10 stands for steps 6-10."""
    with LosslessStorage():
        warm = _train(steps=9, quantization="4bit")
        cold = _train(steps=9, quantization="4bit", statistics_warmup=0)
        later = _train(steps=12, quantization="4bit")
    shampoo, shampoo_later = _train(steps=9), _train(steps=12)
    assert (warm - shampoo).norm() / shampoo.norm() < 1e-5
    assert (cold - shampoo).norm() / shampoo.norm() > 1e-4
    assert (later - shampoo_later).norm() / shampoo_later.norm() > 1e-4


# ---------------------------------------------------------------- sketchy_step_time.py


def test_sketchy_mean_step_weights_each_kind_of_step_over_a_period():
    runner = SimpleNamespace(frequency=10, every=5, steady=[2.0], skipped=[1.0],
                             refresh=[7.0])
    assert mean_step(runner) == pytest.approx((7.0 + 1 * 2.0 + 8 * 1.0) / 10)
    runner = SimpleNamespace(frequency=10, every=1, steady=[2.0], skipped=[], refresh=[7.0])
    assert mean_step(runner) == pytest.approx((7.0 + 9 * 2.0) / 10)


@pytest.mark.parametrize("kernels", list(other_kernels.KERNELS))
def test_other_kernels_a_vector_does_not_move_beside_another(kernels):
    assert other_kernels.moved(other_kernels.ROOT, other_kernels.KERNELS[kernels], [31]) == [0.0]


@pytest.mark.skipif(not emulated_cpu.qemu(),
                    reason=f"qemu-x86_64 is not installed ({emulated_cpu.INSTALL})")
def test_on_an_amd_epycs_kernels_a_vector_does_not_move_beside_another():
    verbose = {"MKL_VERBOSE": "1"}
    values, emulated = other_kernels.run_case(other_kernels.ROOT, verbose, [17, 31],
                                              emulated_cpu.python_command())
    assert values == [0.0, 0.0]
    # on an Intel CPU, not emulated itself, the emulation put MKL on another code path
    if (torch.backends.mkl.is_available() and emulated_cpu.host_vendor() == "GenuineIntel"
            and not emulated_cpu.active()):
        _, native = other_kernels.run_case(other_kernels.ROOT, verbose, [5])
        assert emulated and native and emulated != native, (emulated, native)
