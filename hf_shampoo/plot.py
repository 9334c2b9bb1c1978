"""``python -m hf_shampoo.plot RUN``: a PNG of a Trainer run's loss and the optimizer's health.

``RUN`` is a ``trainer_state.json`` or a folder holding one: a Trainer's ``output_dir``
(``trainer.save_state()`` writes it there) or one of its ``checkpoint-N`` folders (the
newest is taken where the folder itself has none). Its ``log_history`` holds, at every
``logging_steps``, the training loss and the ``optimizer/...`` metrics the Trainer logs
with ``optim="distributed_shampoo"`` / ``"distributed_muon"`` (docs/metrics.md). The figure
draws against step: the loss; the last refresh's seconds; fallbacks; the factors' largest
and median condition numbers; the grafting ratio per kind; the share of blocks
preconditioned and of bases recomputed. A panel whose metric the run did not log says so.

    python -m hf_shampoo.plot out/                      # writes out/optimizer_health.png
    python -m hf_shampoo.plot out/checkpoint-500/trainer_state.json -o health.png

matplotlib is imported only here, when a figure is drawn (``pip install
'hf_shampoo[examples]'``).
"""

from __future__ import annotations

import argparse
import json
import math
import re
from pathlib import Path
from typing import Any

STATE_FILE = "trainer_state.json"
DEFAULT_NAME = "optimizer_health.png"
PREFIX = "optimizer/"
# (title, [(metric, label)], log scale)
PANELS: tuple[tuple[str, tuple[tuple[str, str], ...], bool], ...] = (
    ("training loss", (("loss", "loss"),), False),
    ("last refresh (seconds)", ((PREFIX + "refresh_seconds", "seconds"),), False),
    ("fallbacks since the last log", ((PREFIX + "fallbacks", "fallbacks"),), False),
    ("factor condition number", ((PREFIX + "condition_max", "largest"),
                                 (PREFIX + "condition_median", "median")), True),
    ("grafting ratio ‖graft‖ / ‖P‖", (), True),  # one line per kind: graft_ratio/<kind>
    ("share of blocks", ((PREFIX + "preconditioning", "preconditioned"),
                         (PREFIX + "basis_recomputed_fraction", "bases recomputed")), False),
)


def _matplotlib():
    """matplotlib's ``Figure`` and Agg canvas (no pyplot: no backend is switched)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as error:
        raise ImportError(
            "hf_shampoo.plot draws with matplotlib, which is not installed: "
            "pip install 'hf_shampoo[examples]' (or pip install matplotlib)") from error
    return Figure, FigureCanvasAgg


def state_file(run: str | Path) -> Path:
    """The ``trainer_state.json`` of ``run`` (a file, an output folder, a checkpoint)."""
    path = Path(run)
    if path.is_file():
        return path
    if (path / STATE_FILE).is_file():
        return path / STATE_FILE
    checkpoints = sorted((int(m.group(1)), p) for p in path.glob("checkpoint-*")
                         if (m := re.fullmatch(r"checkpoint-(\d+)", p.name))
                         and (p / STATE_FILE).is_file())
    if checkpoints:
        return checkpoints[-1][1] / STATE_FILE
    raise FileNotFoundError(
        f"hf_shampoo.plot: no {STATE_FILE} in {path} nor in a checkpoint-N folder of it; "
        "pass the file, or call trainer.save_state() after training")


def load_history(run: str | Path) -> list[dict[str, Any]]:
    """The ``log_history`` of a run (see ``state_file``)."""
    with open(state_file(run), encoding="utf-8") as file:
        return json.load(file)["log_history"]


def series(history: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """``(steps, values)`` of the entries that logged ``key`` (NaN kept: a gap)."""
    points = [(entry["step"], float(entry[key])) for entry in history
              if key in entry and "step" in entry and entry[key] is not None]
    return [s for s, _ in points], [v for _, v in points]


def plot(run: str | Path, out: str | Path | None = None) -> Path:
    """Draw ``run``'s loss and health metrics into a PNG (default: ``optimizer_health.png``
    next to its ``trainer_state.json``); returns the PNG's path."""
    source = state_file(run)
    history = load_history(source)
    out = Path(out) if out is not None else source.parent / DEFAULT_NAME
    kinds = sorted({key.removeprefix(PREFIX + "graft_ratio/") for entry in history
                    for key in entry if key.startswith(PREFIX + "graft_ratio/")})
    Figure, Canvas = _matplotlib()
    figure = Figure(figsize=(13, 7.5), layout="constrained")
    Canvas(figure)
    axes = figure.subplots(2, 3, sharex=True).flatten()
    for ax, (title, lines, log) in zip(axes, PANELS):
        if not lines:  # the grafting ratio: one line per kind
            lines = tuple((PREFIX + f"graft_ratio/{kind}", kind) for kind in kinds)
        drawn = False
        for key, label in lines:
            steps, values = series(history, key)
            finite = [v for v in values if math.isfinite(v)]
            if not finite:
                continue
            ax.plot(steps, values, marker="." if len(steps) < 60 else None, label=label)
            drawn = True
            if log and min(finite) <= 0:
                log = False
        ax.set_title(title)
        ax.set_xlabel("step")
        if not drawn:
            ax.text(0.5, 0.5, "not logged in this run", ha="center", va="center",
                    transform=ax.transAxes, color="grey")
            continue
        if log:
            ax.set_yscale("log")
        if len(lines) > 1:
            ax.legend(fontsize="small")
        ax.grid(True, alpha=0.3)
    figure.suptitle(f"{source.parent.name}/{source.name}: loss and optimizer health "
                    "(docs/metrics.md)", fontsize="medium")
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=100)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m hf_shampoo.plot",
        description="Plot a Trainer run's loss and DistributedShampoo's health metrics "
                    "against step (docs/metrics.md).")
    parser.add_argument("run", help=f"a {STATE_FILE}, or a Trainer output_dir / checkpoint "
                                    "folder holding one")
    parser.add_argument("-o", "--output", default=None,
                        help=f"the PNG to write (default: {DEFAULT_NAME} next to the "
                             f"{STATE_FILE})")
    args = parser.parse_args(argv)
    print(plot(args.run, args.output))


if __name__ == "__main__":
    main()
