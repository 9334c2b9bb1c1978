"""benchmarks/end_to_end.py at CPU size (``--tiny``): the runs it times are the ones it
claims (a window of exactly F steps after every Shampoo block has preconditioned, the
Trainer's optimizer built from the ``optim_args`` string, the same initialisation and
first batch for every optimizer), and ``--write`` replaces its section in place."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from benchmarks import end_to_end

pytestmark = pytest.mark.benchmarks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

F, WARMUP = 4, 9  # --tiny: precondition_frequency 4, warm-up 2F + 1
OPTIMIZERS = {
    "resnet50": ["AdamW (fused)", "Shampoo staggered, F=4", "Shampoo all, F=4"],
    "gpt2": ["AdamW (adamw_torch_fused)", "Shampoo staggered, F=4"],
}
OTHER = "# Results\n\nText before.\n\n{section}\n## Later\n\nText after.\n"


def run_script(*args: str) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-m", "benchmarks.end_to_end", "--tiny", "--device",
                           "cpu", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def table_rows(text: str) -> list[list[str]]:
    return [[c.strip() for c in line.strip("|").split("|")] for line in text.splitlines()
            if line.startswith(("| resnet50 |", "| gpt2 |"))]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """One ``--tiny`` run of both workloads, its JSON and a markdown file it wrote into."""
    tmp = tmp_path_factory.mktemp("e2e")
    markdown = tmp / "results.md"
    stale = f"{end_to_end.MARK_BEGIN}\nstale table\n{end_to_end.MARK_END}\n"
    markdown.write_text(OTHER.format(section=stale))
    stdout = run_script("--json", str(tmp / "e2e.json"), "--write", str(markdown))
    return stdout, json.loads((tmp / "e2e.json").read_text()), markdown


def test_table_has_one_row_per_optimizer_and_workload(tiny):
    stdout, saved, _ = tiny
    rows = table_rows(stdout)
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


def test_json_has_the_window_and_same_start_for_every_optimizer(tiny):
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


def test_shampoo_preconditioned_every_block_before_the_window(tiny):
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


def test_trainer_optimizer_got_the_optim_args(tiny):
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


def test_write_replaces_its_section_in_place(tiny, tmp_path):
    stdout, _, markdown = tiny
    table = stdout.strip()
    assert markdown.read_text() == OTHER.format(
        section=f"{end_to_end.MARK_BEGIN}\n{table}\n{end_to_end.MARK_END}\n")
    # a second run (GPT-2 only) replaces the section again: once, other text kept
    second = run_script("--workload", "gpt2", "--write", str(markdown)).strip()
    text = markdown.read_text()
    assert text == OTHER.format(
        section=f"{end_to_end.MARK_BEGIN}\n{second}\n{end_to_end.MARK_END}\n")
    assert text.count(end_to_end.MARK_BEGIN) == text.count(end_to_end.MARK_END) == 1
    assert [r[0] for r in table_rows(text)] == ["gpt2", "gpt2"]
    # a file without the markers gets the section appended
    plain = tmp_path / "plain.md"
    plain.write_text("# Other\n")
    markers = end_to_end.MARK_BEGIN, end_to_end.MARK_END
    end_to_end.write_section(str(plain), "table", *markers)
    end_to_end.write_section(str(plain), "table 2", *markers)
    assert plain.read_text() == (f"# Other\n\n{end_to_end.MARK_BEGIN}\ntable 2\n"
                                 f"{end_to_end.MARK_END}\n")


def test_bad_workload_is_refused_with_the_valid_values(capsys):
    with pytest.raises(SystemExit) as error:
        end_to_end.parse(["--workload", "vit"])
    assert error.value.code == 2
    message = capsys.readouterr().err
    assert "invalid choice: 'vit'" in message
    assert "'resnet50'" in message and "'gpt2'" in message
