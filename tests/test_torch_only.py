"""With torch as the only library (every optional one hidden), the package imports, trains,
checkpoints and describes, and each integration that needs a missing library raises an
``ImportError`` naming the extra to install (``hf_shampoo/optional.py``; README,
"Installation").

The check runs in a fresh interpreter in which a filter wraps every import finder, so that
the optional libraries are absent exactly as on a machine without them: ``import timm``
raises ``ModuleNotFoundError`` and ``importlib.util.find_spec("timm")`` is None (what
``import hf_shampoo`` asks before arranging its lazy registrations).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]
HIDDEN = ("transformers", "accelerate", "timm", "datasets", "sklearn", "peft", "deepspeed",
          "torchvision", "matplotlib")

HIDE = r"""
import importlib.abc, sys

HIDDEN = set(sys.argv[1].split(","))


class Without(importlib.abc.MetaPathFinder):
    '''Wraps a finder: the hidden libraries are not found, the rest is left to it.'''

    def __init__(self, finder):
        self.finder = finder

    def find_spec(self, fullname, path=None, target=None):
        if fullname.partition(".")[0] in HIDDEN:
            return None
        find = getattr(self.finder, "find_spec", None)
        return None if find is None else find(fullname, path, target)

    def invalidate_caches(self):
        getattr(self.finder, "invalidate_caches", lambda: None)()


sys.meta_path[:] = [Without(finder) for finder in sys.meta_path]
"""

CHECKS = r"""
import copy, importlib, importlib.util, io, json, sys, tempfile

import torch
from torch import nn

import hf_shampoo
from hf_shampoo import DistributedShampoo, describe, make_optimizer

report = {"file": hf_shampoo.__file__, "version": hf_shampoo.__version__,
          "find_spec": {name: importlib.util.find_spec(name) is not None for name in HIDDEN}}
report["loaded"] = sorted(name for name in sys.modules if name.partition(".")[0] in HIDDEN)

# ---- train a few steps past the first preconditioner refresh, save, resume identically
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.ReLU(), nn.Linear(32, 4))
data = [(torch.randn(8, 16), torch.randint(0, 4, (8,))) for _ in range(8)]


def steps(model, optimizer, batches):
    for x, y in batches:
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()


optimizer = make_optimizer(model, lr=1e-2, precondition_frequency=2,
                           start_preconditioning_step=2)
before = [p.detach().clone() for p in model.parameters()]
steps(model, optimizer, data[:4])
report["moved"] = all(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
buffer = io.BytesIO()
torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, buffer)
buffer.seek(0)
saved = torch.load(buffer, weights_only=True)
resumed = copy.deepcopy(model)
resumed.load_state_dict(saved["model"])
resumed_optimizer = make_optimizer(resumed, lr=1e-2, precondition_frequency=2,
                                   start_preconditioning_step=2)
resumed_optimizer.load_state_dict(saved["optimizer"])
steps(model, optimizer, data[4:])
steps(resumed, resumed_optimizer, data[4:])
report["resumed_identically"] = all(torch.equal(a, b) for a, b in
                                    zip(model.parameters(), resumed.parameters()))
report["factors"] = sum(1 for state in optimizer.state.values() for key in state
                        if "factor" in key)

# ---- describe
text = describe(optimizer)
rows = optimizer.describe_blocks()
report["describe_names"] = all(name in text for name, _ in model.named_parameters())
report["blocks"] = len(rows)
report["block_keys"] = sorted(rows[0])
plain = DistributedShampoo(model.parameters(), lr=1e-3)
report["describe_plain"] = len(describe(plain).splitlines())


# ---- peft's adapters by name and DeepSpeed's partitions need neither library
class LoraLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.base_layer = nn.Linear(32, 32)
        self.lora_A = nn.ModuleDict({"default": nn.Linear(32, 4, bias=False)})
        self.lora_B = nn.ModuleDict({"default": nn.Linear(4, 32, bias=False)})

    def forward(self, x):
        return self.base_layer(x) + self.lora_B["default"](self.lora_A["default"](x))


adapted = nn.Sequential(LoraLinear())
adapted[0].base_layer.requires_grad_(False)
lora = make_optimizer(adapted, lr=1e-2, overrides={"*lora_*": {"preconditioner":
                                                               "riemannian_lora"}})
x = torch.randn(8, 32)
for _ in range(2):
    lora.zero_grad()
    adapted(x).square().mean().backward()
    lora.step()
report["lora_kinds"] = sorted({row["preconditioner"] for row in lora.describe_blocks()})
importlib.import_module("hf_shampoo.distributors.zero")

# ---- python -m hf_shampoo.run arranges what it can, silently
from hf_shampoo import run

run.register_all()


# ---- each integration whose library is missing names its extra
def message(call):
    try:
        call()
    except ImportError as error:
        return str(error)
    return None


from hf_shampoo.integrations import accelerate as hf_accelerate
from hf_shampoo.integrations import timm as hf_timm
from hf_shampoo.integrations import transformers as hf_transformers

sys.path.insert(0, sys.argv[2])  # the repository root: benchmarks/
state_file = tempfile.mkdtemp() + "/trainer_state.json"  # a Trainer run's log, to plot
with open(state_file, "w") as f:
    json.dump({"log_history": [{"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.5}]}, f)
calls = {
    "Trainer hook (ShampooTrainer)": lambda: hf_transformers.ShampooTrainer,
    "Trainer hook (ShampooCheckpointCallback)":
        lambda: importlib.import_module("hf_shampoo.integrations.transformers")
        .ShampooCheckpointCallback,
    "Trainer registration (register)": hf_transformers.register,
    "accelerate save_state": lambda: hf_accelerate.save_state(object(), tempfile.mkdtemp()),
    "accelerate load_state": lambda: hf_accelerate.load_state(object(), tempfile.mkdtemp()),
    "accelerate register_checkpoint_hook":
        lambda: hf_accelerate.register_checkpoint_hook(object(), optimizer),
    "timm registry (register)": hf_timm.register,
    "plots (python -m hf_shampoo.plot)": lambda: importlib.import_module("hf_shampoo.plot")
        .plot(state_file),
    "plots (benchmarks.memory)":
        lambda: importlib.import_module("benchmarks.memory").plot({}, "plot.png"),
    "plots (benchmarks.ablation)":
        lambda: importlib.import_module("benchmarks.ablation").plot({}, ".", None),
    "peft (benchmarks.lora_pairs)":
        lambda: importlib.import_module("benchmarks.lora_pairs").make_vit_lora(model, 0),
}
report["errors"] = {name: message(call) for name, call in calls.items()}
sys.argv = ["deepspeed_table", "--paths", "accelerate"]
report["errors"]["deepspeed (benchmarks.deepspeed_table)"] = message(
    importlib.import_module("benchmarks.deepspeed_table").main)
report["loaded_at_end"] = sorted(name for name in sys.modules
                                 if name.partition(".")[0] in HIDDEN)
print("REPORT " + json.dumps(report))
"""

# what each call above must name: the extra that brings its library
EXTRA_OF = {
    "Trainer hook (ShampooTrainer)": "transformers",
    "Trainer hook (ShampooCheckpointCallback)": "transformers",
    "Trainer registration (register)": "transformers",
    "accelerate save_state": "accelerate",
    "accelerate load_state": "accelerate",
    "accelerate register_checkpoint_hook": "accelerate",
    "timm registry (register)": "timm",
    "plots (python -m hf_shampoo.plot)": "examples",
    "plots (benchmarks.memory)": "examples",
    "plots (benchmarks.ablation)": "examples",
    "peft (benchmarks.lora_pairs)": "peft",
    "deepspeed (benchmarks.deepspeed_table)": "deepspeed",
}


def run_hidden(hidden: tuple[str, ...], tmp_path: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
        p for p in (str(REPO), env.get("PYTHONPATH")) if p))
    code = HIDE + "HIDDEN = sorted(HIDDEN)\n" + CHECKS
    result = subprocess.run([sys.executable, "-c", code, ",".join(hidden), str(REPO)],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    line = next(x for x in result.stdout.splitlines() if x.startswith("REPORT "))
    return json.loads(line[len("REPORT "):])


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    return run_hidden(HIDDEN, tmp_path_factory.mktemp("torch_only"))


def test_the_libraries_are_hidden_and_this_checkout_is_imported(report):
    assert Path(report["file"]).resolve().is_relative_to(REPO)
    assert report["find_spec"] == {name: False for name in HIDDEN}
    assert report["loaded"] == [] and report["loaded_at_end"] == []


def test_trains_checkpoints_and_resumes_identically(report):
    assert report["moved"]
    assert report["factors"] > 0  # preconditioned steps, not only the grafting method's
    assert report["resumed_identically"]


def test_describes(report):
    assert report["describe_names"] and report["describe_plain"] > 2
    assert report["blocks"] >= 4 and {"param_index", "preconditioner"} <= set(
        report["block_keys"])


def test_peft_adapters_and_deepspeed_partitions_need_neither_library(report):
    """peft's LoRA factors are recognised by name, DeepSpeed's partitions by their links:
    neither library is imported for them."""
    assert "riemannian_lora" in report["lora_kinds"]


@pytest.mark.parametrize("integration", sorted(EXTRA_OF))
def test_a_missing_library_names_its_extra(report, integration):
    error = report["errors"][integration]
    assert error is not None, f"{integration}: no ImportError without its library"
    assert f"pip install 'hf_shampoo[{EXTRA_OF[integration]}]'" in error, error


def test_the_filter_hides_only_what_it_is_told(tmp_path):
    """The filter hides the libraries it is given and no other (so the report above is
    about their absence, not about a filter that hides everything)."""
    code = HIDE + (
        "import importlib.util, json\n"
        "print(json.dumps([importlib.util.find_spec(n) is not None for n in"
        " ('timm', 'pytest', 'torch')]))\n")
    out = subprocess.run([sys.executable, "-c", code, "timm"], capture_output=True, text=True,
                         timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == [False, True, True]
