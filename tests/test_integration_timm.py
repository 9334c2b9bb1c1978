"""Tests of hf_shampoo/integrations/timm.py: the registry entries, timm's parameter groups
(weight decay, diagonal vectors, layer decay with timm's scheduler), ``--device-modules``
in a fresh interpreter, and (slow) timm's train.py and the two-process example."""

from __future__ import annotations

import argparse
import inspect
import os
import re
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import timm
import torch
from timm.optim import OptimInfo, OptimizerRegistry, create_optimizer_v2
from timm.optim.lookahead import Lookahead
from timm.scheduler import CosineLRScheduler

from hf_shampoo import DistributedShampoo
from hf_shampoo.blocking import is_vector_like
from hf_shampoo.integrations import timm as timm_integration
from hf_shampoo.integrations.timm import create_shampoo, register

pytestmark = pytest.mark.integrations

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True, scope="module")
def _registered():
    assert register()


def tiny_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return timm.create_model("test_resnet", pretrained=False, num_classes=10)


def names_by_id(model):
    return {id(p): n for n, p in model.named_parameters()}


def train_steps(model, optimizer, steps=2, seed=0):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(4, 3, 32, 32, generator=gen)
        y = torch.randint(0, 10, (4,), generator=gen)
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()


# ---------------------------------------------------------------------- registry
def test_register_is_idempotent_and_names_have_no_underscore():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert register()
        assert register()
    for name in timm_integration.TIMM_OPTIMIZER_NAMES:
        assert "_" not in name  # timm keeps only the part after the last underscore
    info = timm.optim.get_optimizer_info("shampoo")
    assert info.opt_class is create_shampoo and info.has_betas and info.has_eps
    assert not info.has_momentum  # timm's momentum=0.9 must not become classic momentum
    assert timm.optim.get_optimizer_info("soap").opt_class is timm_integration.create_soap
    assert {"shampoo", "soap", "klshampoo"} <= set(timm.optim.list_optimizers())


@pytest.mark.parametrize("name", ["shampoo", "soap", "klshampoo"])
def test_timm_gets_real_optimizer_classes_with_its_signature(name):
    """What timm's own factory test checks: an Optimizer subclass whose signature has the
    eps / betas its OptimInfo declares; a flat list is one group whose lr governs all."""
    import inspect

    cls = timm.optim.get_optimizer_class(name, bind_defaults=False)
    assert inspect.isclass(cls) and issubclass(cls, torch.optim.Optimizer)
    assert issubclass(cls, DistributedShampoo)
    assert {"eps", "betas", "lr", "weight_decay"} <= set(inspect.signature(cls).parameters)
    model = tiny_model()
    opt = cls(model.parameters(), lr=1e-2)
    assert len(opt.param_groups) == 1
    train_steps(model, opt, steps=2)
    before = [p.detach().clone() for p in model.parameters()]
    opt.param_groups[0]["lr"] = 0.0
    train_steps(model, opt, steps=2)
    assert all(torch.equal(p.detach(), b) for p, b in zip(model.parameters(), before))


def test_register_leaves_a_foreign_optimizer_of_the_same_name():
    registry = OptimizerRegistry()
    registry.register(OptimInfo(name="shampoo", opt_class=torch.optim.SGD))
    with pytest.warns(UserWarning, match="already has an optimizer named 'shampoo'"):
        assert register(registry)
    assert registry.get_optimizer_info("shampoo").opt_class is torch.optim.SGD
    assert registry.get_optimizer_info("soap").opt_class is timm_integration.create_soap
    register(registry, force=True)
    assert registry.get_optimizer_info("shampoo").opt_class is create_shampoo


def test_register_without_a_timm_registry(monkeypatch):
    monkeypatch.setattr(timm_integration, "_FACTORY_MODULE", "timm.optim.adamw")  # no registry
    with pytest.warns(UserWarning, match="timm >= 1.0.12"):
        assert register() is False
    monkeypatch.setattr(timm_integration, "_FACTORY_MODULE", "no_such_module_for_hf_shampoo")
    assert register() is False


# ---------------------------------------------------------------------- parameter groups
def test_create_optimizer_v2_groups_weight_decay_and_diagonal_vectors():
    model = tiny_model()
    opt = create_optimizer_v2(model, opt="shampoo", lr=1e-3, weight_decay=0.05)
    assert isinstance(opt, DistributedShampoo)
    names = names_by_id(model)
    seen = [id(p) for g in opt.param_groups for p in g["params"]]
    assert sorted(seen) == sorted(names) and len(seen) == len(set(seen))
    # timm's two groups (decay / no decay), not split further: vectors are diagonal
    # inside their group (vector_preconditioner), so each group's lr governs all of it
    assert len(opt.param_groups) == 2
    kinds = {(r["param_index"]): r["preconditioner"] for r in opt.describe_blocks()}
    index = {id(p): i for i, p in enumerate(p for g in opt.param_groups for p in g["params"])}
    for group in opt.param_groups:
        assert group["preconditioner"] == "shampoo"
        assert group["vector_preconditioner"] == "diagonal"
        for p in group["params"]:
            vector = is_vector_like(p.shape)
            assert group["weight_decay"] == (0.0 if vector else 0.05), names[id(p)]
            assert kinds[index[id(p)]] == ("diagonal" if vector else "shampoo"), names[id(p)]
        # the AdamW migration (docs/hyperparameters.md), with decoupled decay as timm passes it
        assert group["betas"] == (0.9, 0.999)
        assert group["rank_deficient"] == "pseudo_inverse" and group["epsilon"] == 0.0
        assert group["rank_rtol"] is None
        assert group["grafting"] == "adam" and group["grafting_beta2"] == 0.999
        assert group["grafting_epsilon"] == 1e-8 and group["weight_decay_type"] == "decoupled"
    bias = next(g for g in opt.param_groups if any(p is model.fc.bias for p in g["params"]))
    assert bias["weight_decay"] == 0.0 and kinds[index[id(model.fc.bias)]] == "diagonal"
    train_steps(model, opt)
    rows = opt.describe_blocks()
    assert {r["param_index"] for r in rows} == set(range(len(seen)))


def test_timm_arguments_map_to_shampoo_keywords():
    model = tiny_model()
    opt = create_optimizer_v2(
        model, opt="shampoo", lr=0.01, eps=1e-6, betas=[0.8, 0.99], momentum=0.9,
        foreach=True, precondition_frequency=7, max_preconditioner_dim=64,
    )
    group = opt.param_groups[0]
    assert group["lr"] == 0.01 and group["betas"] == (0.8, 0.99)
    assert group["grafting_epsilon"] == 1e-6 and group["grafting_beta2"] == 0.99
    assert group["momentum"] == 0.0  # timm drops momentum: has_momentum=False
    assert group["precondition_frequency"] == 7 and group["max_preconditioner_dim"] == 64
    opt = create_optimizer_v2(model, opt="shampoo", grafting_epsilon=1e-5, eps=1e-6)
    assert opt.param_groups[0]["grafting_epsilon"] == 1e-5  # an explicit keyword wins
    with pytest.raises(ValueError, match="unknown keyword.*'precondition_freq'.*valid keywords"):
        create_optimizer_v2(model, opt="shampoo", precondition_freq=7)
    # an explicit epsilon selects Meta's perturbation
    opt = create_optimizer_v2(model, opt="klshampoo", epsilon=1e-12)
    group = opt.param_groups[0]
    assert group["rank_deficient"] == "perturbation" and group["epsilon"] == 1e-12


def _direction_after_a_dtype_change(name: str, seed: int, **kwargs) -> float:
    """timm's state-dict contract: an optimizer primed in float32, its state loaded into
    a float64 copy, both stepped 5 times on ``(W x + b)²`` (rank-1 gradients: the merged
    50 x 50 factor stays rank-deficient): the cosine of the two parameter movements."""
    g = torch.Generator().manual_seed(seed)
    weight = torch.nn.Parameter(torch.randn(10, 5, generator=g))
    bias = torch.nn.Parameter(torch.randn(10, generator=g))
    x = torch.randn(5, generator=g)

    def run(opt, w, b, steps):
        for _ in range(steps):
            opt.zero_grad()
            (w.mv(x.to(w.dtype)) + b).pow(2).sum().backward()
            opt.step()

    opt = create_optimizer_v2([weight, bias], opt=name, lr=1e-2, **kwargs)
    run(opt, weight, bias, 20)
    w64 = torch.nn.Parameter(weight.detach().double().clone())
    b64 = torch.nn.Parameter(bias.detach().double().clone())
    opt64 = create_optimizer_v2([w64, b64], opt=name, lr=1e-2, **kwargs)
    opt64.load_state_dict(opt.state_dict())
    start = torch.cat([weight.detach().flatten(), bias.detach()]).double()
    run(opt, weight, bias, 5)
    run(opt64, w64, b64, 5)
    moved = torch.cat([weight.detach().flatten(), bias.detach()]).double() - start
    moved64 = torch.cat([w64.detach().flatten(), b64.detach()]) - start
    return torch.nn.functional.cosine_similarity(moved, moved64, dim=0).item()


@pytest.mark.parametrize("name", ["shampoo", "klshampoo"])
def test_float32_and_float64_copies_move_alike(name):
    """With the pseudo-inverse default the float32 run and its float64 copy agree; Meta's
    ε = 1e-12 perturbation amplifies the null space's round-off instead."""
    assert min(_direction_after_a_dtype_change(name, seed) for seed in range(5)) > 0.99
    assert min(_direction_after_a_dtype_change(name, seed, epsilon=1e-12)
               for seed in range(5)) < 0.9


def test_diagonal_opt_out_and_plain_parameter_iterables():
    model = tiny_model()
    whole = create_optimizer_v2(model, opt="shampoo", diagonal_1d=False)
    assert [g["vector_preconditioner"] for g in whole.param_groups] == [None]
    plain = create_optimizer_v2(model.parameters(), opt="shampoo", lr=1e-3)
    assert len(plain.param_groups) == 1  # a flat list stays one group
    assert plain.param_groups[0]["vector_preconditioner"] == "diagonal"
    mine = create_optimizer_v2(model, opt="shampoo", preconditioner="diagonal")
    assert {g["preconditioner"] for g in mine.param_groups} == {"diagonal"}


def test_vector_like_tensors():
    assert is_vector_like((8,)) and is_vector_like(())
    assert is_vector_like((1, 1, 8))  # layer scale, class token
    assert not is_vector_like((8, 3)) and not is_vector_like((4, 1, 3, 3))


def test_diagonal_groups_step_exactly_like_adamw():
    """Biases and norms get AdamW's update (Adam grafting alone, docs/design.md §2 line 5)."""
    model = tiny_model()
    twin = tiny_model()
    shampoo = create_optimizer_v2(model, opt="shampoo", lr=1e-2, weight_decay=0.1,
                                  precondition_frequency=2)
    adamw = create_optimizer_v2(twin, opt="adamw", lr=1e-2, weight_decay=0.1)
    gen = torch.Generator().manual_seed(1)
    for _ in range(4):
        for p, q in zip(model.parameters(), twin.parameters()):
            p.grad = torch.randn(p.shape, generator=gen)
            q.grad = p.grad.clone()
        shampoo.step()
        adamw.step()
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        if is_vector_like(p.shape):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


def test_fallback_groups_become_diagonal():
    if "fallback_list" not in inspect.signature(create_optimizer_v2).parameters:
        pytest.skip("this timm has no fallback_list (its hybrid optimizers came after 1.0.12)")
    model = tiny_model()
    opt = create_optimizer_v2(model, opt="shampoo", weight_decay=0.05, fallback_list=["fc.*"])
    fc = next(g for g in opt.param_groups if any(p is model.fc.weight for p in g["params"]))
    assert fc["preconditioner"] == "diagonal" and "use_fallback" not in fc


# ---------------------------------------------------------------------- layer decay
def test_layer_decay_lr_scale_is_applied_once_with_timm_scheduler():
    model = tiny_model()
    twin = tiny_model()
    opt = create_optimizer_v2(model, opt="shampoo", lr=1e-2, weight_decay=0.05, layer_decay=0.5)
    ref = create_optimizer_v2(twin, opt="adamw", lr=1e-2, weight_decay=0.05, layer_decay=0.5)
    scales = {g["lr_scale"] for g in opt.param_groups}
    assert len(scales) > 2 and max(scales) == 1.0
    for group in opt.param_groups:  # applied at construction, base kept for the scheduler
        assert group["initial_lr"] == 1e-2
        assert group["lr"] == pytest.approx(1e-2 * group["lr_scale"])
    scheds = [CosineLRScheduler(o, t_initial=10, warmup_t=2, warmup_lr_init=1e-4,
                                t_in_epochs=False) for o in (opt, ref)]
    for t in (0, 1, 3, 7):
        for s in scheds:
            s.step_update(t)
        ref_lr = {g["lr_scale"]: g["lr"] for g in ref.param_groups}
        for group in opt.param_groups:  # exactly what timm gives AdamW: value * lr_scale
            assert group["lr"] == pytest.approx(ref_lr[group["lr_scale"]], rel=1e-12)


def test_layer_decay_changes_the_step_of_each_group():
    """At step 1 an Adam-grafted diagonal step moves each entry by about its group's lr."""
    model = tiny_model()
    opt = create_optimizer_v2(model, opt="shampoo", lr=1e-2, layer_decay=0.5)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    train_steps(model, opt, steps=1)
    names = names_by_id(model)
    checked = set()
    for group in opt.param_groups:
        for p in group["params"]:
            if not is_vector_like(p.shape):  # the diagonal ones (vector_preconditioner)
                continue
            moved = (p.detach() - before[names[id(p)]]).abs()
            moved = moved[moved > 0]
            if moved.numel():
                assert moved.max() == pytest.approx(1e-2 * group["lr_scale"], rel=1e-3)
                checked.add(group["lr_scale"])
    assert len(checked) > 2


def test_lr_scale_opt_out_leaves_it_to_the_scheduler():
    opt = create_optimizer_v2(tiny_model(), opt="shampoo", lr=1e-2, layer_decay=0.5,
                              apply_lr_scale=False)
    assert all(g["lr"] == 1e-2 and "initial_lr" not in g for g in opt.param_groups)
    CosineLRScheduler(opt, t_initial=10, t_in_epochs=False)
    assert all(g["lr"] == pytest.approx(1e-2 * g["lr_scale"]) for g in opt.param_groups)


# ---------------------------------------------------------------------- other names
def test_soap_klshampoo_and_lookahead():
    model = tiny_model()
    soap = create_optimizer_v2(model, opt="soap", lr=1e-3, weight_decay=0.05, eps=1e-7)
    kinds = {(r["preconditioner"], r["grafting"]) for r in soap.describe_blocks()}
    assert kinds == {("eigenvalue_corrected", None), ("diagonal", "adam")}
    assert all(g["epsilon"] == 1e-7 and g["grafting_epsilon"] == 1e-7 for g in soap.param_groups)
    train_steps(model, soap)
    kl = create_optimizer_v2(model, opt="klshampoo", lr=1e-3, weight_decay=0.05)
    kinds = {(r["preconditioner"], r["grafting"]) for r in kl.describe_blocks()}
    assert kinds == {("kl_shampoo", "adam"), ("diagonal", "adam")}
    train_steps(model, kl)
    wrapped = create_optimizer_v2(model, opt="lookahead_shampoo", lr=1e-3)
    assert isinstance(wrapped, Lookahead)
    assert isinstance(wrapped._base_optimizer, DistributedShampoo)
    train_steps(model, wrapped)


# ---------------------------------------------------------------------- train.py's path
TRAIN_PY_LIKE = """
import argparse, importlib, sys
import timm
from timm.optim import create_optimizer_v2, optimizer_kwargs
{imports}
# what timm's train.py does with --device-modules hf_shampoo --opt shampoo --opt-kwargs ...
args = argparse.Namespace(opt="shampoo", lr=1e-3, weight_decay=2e-5, momentum=0.9,
                          opt_eps=None, opt_betas=None, layer_decay=0.75,
                          layer_decay_min_scale=0, layer_decay_no_opt_scale=None)
model = timm.create_model("test_resnet", pretrained=False, num_classes=10)
opt = create_optimizer_v2(model, **optimizer_kwargs(cfg=args), precondition_frequency=5)
print(type(opt).__name__, len(opt.param_groups), opt.param_groups[0]["precondition_frequency"])
"""


@pytest.mark.parametrize("order", ["timm_first", "hf_shampoo_first"])
def test_device_modules_import_registers_in_a_fresh_interpreter(order, tmp_path):
    """timm's train.py imports each --device-modules module with importlib.import_module;
    train.py itself ships only in timm's repository, so this runs the same calls."""
    if order == "timm_first":
        code = TRAIN_PY_LIKE.format(imports='importlib.import_module("hf_shampoo")')
    else:
        code = 'import hf_shampoo\nassert "timm" not in sys.modules\n' + TRAIN_PY_LIKE.format(
            imports="")
        code = "import sys\n" + code
    # cwd outside the checkout: the installed hf_shampoo is imported, as under train.py
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                         text=True, timeout=120, cwd=tmp_path, check=False)
    assert out.returncode == 0, out.stderr
    name, groups, frequency = out.stdout.split()
    assert (name, frequency) == ("TimmShampoo", "5") and int(groups) > 2  # layer decay


def write_digits_image_folder(root: Path, count: int = 300) -> Path:
    """scikit-learn digits as 32x32 RGB PNGs in ImageFolder layout (train / validation)."""
    import numpy as np
    from PIL import Image
    from sklearn.datasets import load_digits

    digits = load_digits()
    for i, (image, target) in enumerate(zip(digits.images[:count], digits.target[:count])):
        folder = root / ("validation" if i % 5 == 0 else "train") / str(target)
        folder.mkdir(parents=True, exist_ok=True)
        pixels = (image * 16).clip(0, 255).astype(np.uint8)
        Image.fromarray(pixels).convert("RGB").resize((32, 32)).save(folder / f"{i}.png")
    return root


@pytest.mark.slow
def test_timm_train_py(tmp_path):
    """timm's own train.py (from its repository; set HF_SHAMPOO_TIMM_TRAIN_PY to its path)."""
    train_py = os.environ.get("HF_SHAMPOO_TIMM_TRAIN_PY")
    if not train_py or not Path(train_py).is_file():
        pytest.skip("timm's train.py is not in the wheel; set HF_SHAMPOO_TIMM_TRAIN_PY")
    data = write_digits_image_folder(tmp_path / "digits")
    cmd = [sys.executable, train_py, "--data-dir", str(data), "--model", "test_resnet",
           "--num-classes", "10", "--img-size", "32", "--batch-size", "16", "--epochs", "2",
           "--warmup-epochs", "1", "--sched-on-updates", "--device", "cpu", "--workers", "0",
           "--no-prefetcher", "--device-modules", "hf_shampoo", "--opt", "shampoo",
           "--lr", "1e-3", "--weight-decay", "0.05", "--layer-decay", "0.8",
           "--opt-kwargs", "precondition_frequency=5", "max_preconditioner_dim=256",
           "--output", str(tmp_path / "out")]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path,
                         env={**os.environ, "OMP_NUM_THREADS": "2"}, check=False)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-3000:]
    assert "Created DistributedShampoo (shampoo) optimizer" in log
    assert list((tmp_path / "out").rglob("last.pth.tar"))


@pytest.mark.slow
def test_example_on_two_processes():
    """examples/finetune_timm_resnet50.py with a tiny model on 2 CPU processes (torchrun)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           "2", str(ROOT / "examples" / "finetune_timm_resnet50.py"), "--model", "test_resnet",
           "--steps", "6", "--image-size", "32", "--batch-size", "8",
           "--precondition-frequency", "3", "--cpu"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT,
                         env={**os.environ, "OMP_NUM_THREADS": "1"}, check=False)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-3000:]
    assert "on 2 process(es)" in log
    memory = re.search(r"optimizer state per rank.*: rank 0: ([\d.]+) MiB, rank 1: ([\d.]+) MiB",
                       log)
    assert memory and float(memory.group(1)) > 0 and float(memory.group(2)) > 0
    blocks = re.search(r"blocks per rank.*: rank 0: (\d+) blocks.*rank 1: (\d+) blocks", log)
    assert blocks and int(blocks.group(1)) > 0 and int(blocks.group(2)) > 0
    # staggered refreshes (timm's default): the summary names the slowest step, no split
    assert "refresh_schedule='staggered'" in log
    assert re.search(r"slowest step: step \d+, \d+ ms = [\d.]+x the median step", log), \
        log[-2000:]
    # the health lines from optimizer.metrics(), reduced over both ranks
    health = re.search(r"preconditioning (\d+)% of blocks after 6 steps; last refresh "
                       r"(\d+) blocks in [\d.]+ s; 0 fallbacks", log)
    assert health and int(health.group(2)) > 0, log[-2000:]
    assert re.search(r"factor condition numbers: largest [\d.e+]+, median [\d.e+]+", log)


@pytest.mark.slow
def test_example_with_a_local_image_folder_dataset(tmp_path):
    """--dataset with a local ImageFolder directory: the Image / ClassLabel columns are found."""
    data = write_digits_image_folder(tmp_path / "digits", count=60)
    cmd = [sys.executable, str(ROOT / "examples" / "finetune_timm_resnet50.py"), "--dataset",
           str(data), "--eval-split", "validation", "--model", "test_resnet", "--steps", "3",
           "--image-size", "32", "--batch-size", "8", "--precondition-frequency", "2"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path,
                         env={**os.environ, "HF_DATASETS_OFFLINE": "1",
                              "HF_HOME": str(tmp_path / "hf")}, check=False)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-3000:]
    assert "10 classes" in log and "eval accuracy" in log


def test_example_arguments():
    """The example's command line parses with the documented defaults (no run)."""
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import finetune_timm_resnet50 as example
    finally:
        sys.path.pop(0)
    args = example.parse_args([])
    assert (args.model, args.opt, args.pretrained) == ("resnet50", "shampoo", False)
    assert isinstance(example.parse_args(["--dataset", "cifar10"]), argparse.Namespace)
    state = {0: {"a": torch.zeros(3), "b": [torch.zeros(2, dtype=torch.float16)]}}
    assert example.state_bytes(state) == 16
