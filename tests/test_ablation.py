"""benchmarks/ablation.py end to end: ``--smoke`` runs the whole pipeline (sweep, seeds,
ablations, tables, plots, JSON) and its runs are comparable (same initialisation and
batches for every optimizer); benchmarks/tasks.py reads Hugging Face datasets from disk
into the same tensors as the bundled data."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from benchmarks import ablation, tasks

pytestmark = pytest.mark.benchmarks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_script(*args: str) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-m", "benchmarks.ablation", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.mark.slow
def test_smoke_runs_the_whole_pipeline(tmp_path):
    out = tmp_path / "smoke"
    stdout = run_script("--smoke", "--out", str(out))
    saved = json.loads((out / "ablation.json").read_text())
    records = {r["task"]: r for r in saved["records"]}
    assert set(records) == {"resnet", "gpt2"}
    for task, record in records.items():
        assert os.path.getsize(out / f"ablation_{task}.png") > 10_000
        expected = [n for n, o in ablation.OPTIMIZERS.items() if task in o.tasks and o.default]
        assert list(record["runs"]) == expected
        first_losses = set()
        for name, runs in record["runs"].items():
            # the learning rate is the sweep's argmin of the tail loss, on seed 0
            sweep = record["sweep"][name]
            assert len(sweep) == 2
            assert float(min(sweep, key=sweep.get)) == record["chosen"][name]
            assert [r["seed"] for r in runs] == [0, 1]
            for run in runs:
                assert len(run["losses"]) == 20 and not run["diverged"]
                assert all(math.isfinite(v) for v in run["losses"])
                assert run["seconds"] == sorted(run["seconds"]) and run["seconds"][0] > 0
                assert set(run["metrics"]) >= {record["metric"]}
                if run["seed"] == 0:
                    first_losses.add(run["losses"][0])
        for runs in record["ablations"].values():
            first_losses.add(runs[0]["losses"][0])
        # same model, same first batch for every optimizer: one loss before any update
        assert len(first_losses) == 1, first_losses
        assert f"#### {record['title']}" in stdout
    assert set(records["resnet"]["ablations"]) == set(ablation.ABLATIONS)
    assert os.path.getsize(out / "ablation_resnet_variants.png") > 10_000
    assert records["gpt2"]["ablations"] == {}
    # the tables are a function of the JSON: --replot prints them again, identically
    replotted = run_script("--replot", str(out / "ablation.json"), "--out", str(tmp_path / "re"))
    tables = lambda text: [line for line in text.splitlines() if line.startswith("|")]  # noqa: E731
    assert tables(replotted) == tables(stdout) and tables(stdout)


def test_ablations_split_over_processes_merge(tmp_path):
    """``--base-lr`` runs only the ablations; ``--replot`` of both files gives one record
    whose ablation table has the base row and the given learning rate."""
    common = ["--tasks", "gpt2", "--steps", "3", "--text-batch-size", "2", "--val-windows", "2"]
    run_script(*common, "--seeds", "1", "--lr-points", "1", "--ablation-tasks",
               "--optimizers", ablation.BASE, "--out", str(tmp_path / "a"))
    run_script(*common, "--base-lr", "1e-3", "--ablation-tasks", "gpt2", "--ablation-seeds", "1",
               "--out", str(tmp_path / "b"))
    merged = run_script("--replot", str(tmp_path / "a" / "ablation.json"),
                        str(tmp_path / "b" / "ablation.json"), "--out", str(tmp_path / "c"))
    assert f"| {ablation.BASE} (base) | 0.001 |" in merged
    assert "| grafting sgd | 0.001 |" in merged
    assert os.path.getsize(tmp_path / "c" / "ablation_gpt2_variants.png") > 10_000


def test_bad_optimizer_or_ablation_name_is_refused(capsys):
    with pytest.raises(SystemExit):
        ablation.parse(["--optimizers", "Adam"])
    assert "--optimizers: unknown ['Adam']" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        ablation.parse(["--ablations", "grafting adamw"])
    assert "--ablations: unknown ['grafting adamw']" in capsys.readouterr().err


def test_hugging_face_datasets_from_disk_match_the_bundled_data(tmp_path):
    datasets = pytest.importorskip("datasets")
    from PIL import Image

    x, y, xt, yt = tasks.digits_split(0)
    to_images = lambda rows: [Image.fromarray((r.view(8, 8) * 255).round().byte().numpy())  # noqa: E731
                              for r in rows]
    images = datasets.DatasetDict(
        train=datasets.Dataset.from_dict({"image": to_images(x), "label": y.tolist()}),
        test=datasets.Dataset.from_dict({"image": to_images(xt), "label": yt.tolist()}))
    images.save_to_disk(str(tmp_path / "images"))
    loaded = tasks.image_dataset(str(tmp_path / "images"), 8)
    assert loaded[0].shape == (len(y), 1, 8, 8) and loaded[4] == 10
    torch.testing.assert_close(loaded[0].flatten(1), x, atol=0.501 / 255, rtol=0)  # 8-bit pixels
    assert torch.equal(loaded[1], y) and torch.equal(loaded[3], yt)

    stdout = run_script("--tasks", "resnet", "--image-dataset", str(tmp_path / "images"),
                        "--steps", "3", "--seeds", "1", "--lr-points", "1", "--optimizers",
                        "AdamW", "--ablation-tasks", "--out", str(tmp_path / "run"))
    assert f"on {tmp_path / 'images'}, 16×16" in stdout

    docs = ["def f():\n    return 1", "class A:\n    pass", "x = 'é'"] * 10
    datasets.Dataset.from_dict({"text": docs}).save_to_disk(str(tmp_path / "text"))
    train, val = tasks.text_tokens(str(tmp_path / "text"))
    assert bytes(train.byte().tolist()) == "\n".join(docs[:27]).encode()  # last 10 % held out
    assert bytes(val.byte().tolist()) == "\n".join(docs[27:]).encode()

    with pytest.raises(ValueError, match="columns"):
        tasks.text_tokens(str(tmp_path / "images"))


def test_lora_task_fine_tunes_adapters_with_each_optimizers_state_measured(tmp_path):
    """The LoRA task: every optimizer starts from the same trained base and adapters (one
    first loss), trains only the adapters, and reports its state; by the module rules
    Shampoo's state is at most 3x AdamW's, on model.parameters() it is much larger."""
    out = tmp_path / "lora"
    stdout = run_script("--tasks", "lora", "--steps", "4", "--lora-base-steps", "3",
                        "--seeds", "1", "--lr-points", "1", "--max-lr-points", "1",
                        "--text-batch-size", "2", "--val-windows", "4", "--gpt2-width", "32",
                        "--out", str(out))
    record = json.loads((out / "ablation.json").read_text())["records"][0]
    assert record["task"] == "lora"
    assert list(record["runs"]) == [n for n, o in ablation.OPTIMIZERS.items()
                                    if "lora" in o.tasks and o.default]
    runs = {name: runs[0] for name, runs in record["runs"].items()}
    assert len({run["losses"][0] for run in runs.values()}) == 1
    state = {name: run["metrics"]["optimizer state MiB"] for name, run in runs.items()}
    assert 0 < state["AdamW"] and state["Shampoo (Adam grafting, module rules)"] <= 3 * state[
        "AdamW"] < state["Shampoo (Adam grafting)"]
    assert "trained 3 steps with AdamW" in stdout and "| optimizer state MiB |" in stdout


def test_finetune_task_trains_every_parameter_from_the_lora_tasks_base(tmp_path):
    """The full fine-tune: every optimizer starts from the LoRA task's pre-trained GPT-2 (one
    first loss, the base's validation loss in the title), every parameter trains, and the
    state covers them all (AdamW's: two numbers per parameter)."""
    out = tmp_path / "finetune"
    stdout = run_script("--tasks", "finetune", "--steps", "3", "--lora-base-steps", "3",
                        "--seeds", "1", "--lr-points", "1", "--max-lr-points", "1",
                        "--text-batch-size", "2", "--val-windows", "4", "--gpt2-width", "32",
                        "--optimizers", "AdamW", "Sketchy (rank 8)", "--out", str(out))
    record = json.loads((out / "ablation.json").read_text())["records"][0]
    assert record["task"] == "finetune" and list(record["runs"]) == ["AdamW", "Sketchy (rank 8)"]
    runs = {name: runs[0] for name, runs in record["runs"].items()}
    assert len({run["losses"][0] for run in runs.values()}) == 1
    base = ablation.lora_base(32, 3, 2)
    size = sum(p.numel() for p in base.parameters())
    assert f"full fine-tune (all {size / 1e3:.0f}k parameters)" in stdout
    assert runs["AdamW"]["metrics"]["optimizer state MiB"] == pytest.approx(
        2 * 4 * size / 2**20, rel=1e-3)


def test_docstrings_are_prose_from_the_same_modules():
    train, val = tasks.docstring_tokens()
    text = bytes(train[:20000].byte().tolist()).decode()
    assert len(train) > 100_000 and len(val) > 10_000
    assert "def " not in text.split("\n\n")[0] and text.count(" the ") > 50
