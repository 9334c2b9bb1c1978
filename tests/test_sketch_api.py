"""``make_optimizer(memory=...)`` and the Trainer's ``optim_args`` ``memory=sketch``: Shampoo's
groups become ``preconditioner="sketchy"`` for the whole model, the other kinds keep theirs,
and ``describe()`` shows each sketched dim's rank and each parameter's state."""

from __future__ import annotations

import pytest
import torch

from hf_shampoo import factory
from hf_shampoo.describe_table import _size, describe, describe_rows
from hf_shampoo.factory import make_optimizer

pytestmark = pytest.mark.integrations

transformers = pytest.importorskip("transformers")

VOCAB = 96
RANK = 8  # dims larger than 8 keep a rank-8 sketch (sketch_threshold defaults to sketch_rank)


def tiny_gpt2():
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB,
                                     n_positions=16, bos_token_id=0, eos_token_id=0,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(config)


def lora_gpt2():
    peft = pytest.importorskip("peft", reason="peft is a test extra")
    # adapters on the attention, and the MLP's first matrix trained whole (modules_to_save)
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"],
                           modules_to_save=["c_fc"], fan_in_fan_out=True, lora_dropout=0.0)
    return peft.get_peft_model(tiny_gpt2(), lora)


def one_step(model, optimizer) -> float:
    x = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(1))
    optimizer.zero_grad()
    loss = model(input_ids=x, labels=x).loss
    loss.backward()
    optimizer.step()
    return float(loss.detach())


def build(model_fn, memory, **kwargs):
    model = model_fn()
    optimizer = make_optimizer(model, lr=1e-3, max_preconditioner_dim=64, memory=memory,
                               sketch_rank=RANK, **kwargs)
    return model, optimizer


def labels(optimizer) -> dict[str, str]:
    return {row["name"]: row["preconditioner"] for row in describe_rows(optimizer)}


@pytest.mark.parametrize("model_fn", [tiny_gpt2, lora_gpt2], ids=["gpt2", "lora"])
def test_sketch_turns_shampoo_groups_sketchy_and_keeps_the_others(model_fn):
    full_model, full = build(model_fn, "full")
    model, sketch = build(model_fn, "sketch")
    full_labels, sketch_labels = labels(full), labels(sketch)
    assert full_labels.keys() == sketch_labels.keys()
    sketched = 0
    for name, label in full_labels.items():
        adapter = ".lora_A." in name or ".lora_B." in name
        if label.startswith("shampoo") and not adapter:
            assert sketch_labels[name].startswith("sketchy"), name
            sketched += 1
        else:  # Adam (diagonal) for vectors and small tables, LoRA adapters' Shampoo with
            # their long side diagonal (r x r factors and a diagonal: less than a sketch)
            assert sketch_labels[name] == label, name
    assert sketched >= 2
    if model_fn is lora_gpt2:  # the adapters keep Shampoo, the MLP matrices trained whole sketch
        assert any(".lora_A." in n and v.startswith("shampoo") for n, v in sketch_labels.items())
        assert all(v.startswith("sketchy") for n, v in sketch_labels.items()
                   if "c_fc.modules_to_save" in n and n.endswith("weight"))

    full_loss, loss = one_step(full_model, full), one_step(model, sketch)
    assert loss == pytest.approx(full_loss)  # the same model and batch before the step
    full_bytes = full.metrics()["optimizer/state_bytes"]
    sketch_bytes = sketch.metrics()["optimizer/state_bytes"]
    assert 0 < sketch_bytes < full_bytes
    assert sketch_bytes == sum(row["state_bytes"] for row in describe_rows(sketch))
    # later steps (the sketches' first refresh included) stay finite
    for _ in range(2):
        assert torch.isfinite(torch.tensor(one_step(model, sketch)))
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_memory_full_is_the_default():
    a = make_optimizer(tiny_gpt2(), lr=1e-3)
    b = make_optimizer(tiny_gpt2(), lr=1e-3, memory="full")
    strip = [{k: v for k, v in g.items() if k != "params"} for g in a.param_groups]
    assert strip == [{k: v for k, v in g.items() if k != "params"} for g in b.param_groups]
    assert not any(g["preconditioner"] == "sketchy" for g in b.param_groups)


def test_describe_shows_the_sketch_rank_and_the_state_per_row():
    model, optimizer = build(tiny_gpt2, "sketch")
    rows = {row["name"]: row for row in describe_rows(optimizer)}
    # (32, 128): both dims larger than 8, each a rank-8 sketch
    assert rows["transformer.h.0.mlp.c_fc.weight"]["preconditioner"] == \
        f"sketchy (rank {RANK} on dims 0,1)"
    # the token table: its vocabulary dim off, its hidden dim sketched
    assert rows["transformer.wte.weight"]["preconditioner"] == \
        f"sketchy (dim 0 off) (rank {RANK} on dim 1)"
    # sketch_threshold above every dim: sketchy keeps full factors, and says so
    _, wide = build(tiny_gpt2, "sketch", sketch_threshold=1000)
    assert labels(wide)["transformer.h.0.mlp.c_fc.weight"] == "sketchy (no dim sketched)"
    text = describe(optimizer)
    assert text.splitlines()[0].split()[-1] == "state"
    line = next(ln for ln in text.splitlines() if ln.startswith("transformer.h.0.mlp.c_fc.weight"))
    assert f"sketchy (rank {RANK} on dims 0,1)" in line
    assert line.endswith(_size(rows["transformer.h.0.mlp.c_fc.weight"]["state_bytes"]))
    assert sum(r["state_bytes"] for r in rows.values()) == \
        sum(b["state_bytes"] for b in optimizer.describe_blocks())


def test_bad_memory_is_refused_before_anything_is_built(monkeypatch):
    def built(*args, **kwargs):
        raise AssertionError("built before memory was checked")

    monkeypatch.setattr(factory, "param_groups", built)
    with pytest.raises(ValueError, match=r"memory='sketchy'.*'full'.*'sketch'.*did you mean "
                                         r"'sketch'"):
        make_optimizer(tiny_gpt2(), memory="sketchy")
    with pytest.raises(ValueError, match="memory=None"):
        make_optimizer(tiny_gpt2(), memory=None)


@pytest.mark.parametrize("keywords, message", [
    ({"preconditioner": "eigenvalue_corrected"}, "memory='sketch' with preconditioner="
                                                 "'eigenvalue_corrected'"),
    ({"preconditioner": "kl_shampoo"}, "memory='sketch' with preconditioner='kl_shampoo'"),
    ({"diagonal_aspect": 16.0}, "memory='sketch' with diagonal_aspect=16.0 for the whole model"),
])
def test_kinds_without_a_sketched_form_are_refused(keywords, message):
    with pytest.raises(ValueError, match=message):
        make_optimizer(tiny_gpt2(), lr=1e-3, memory="sketch", **keywords)


def test_a_keyword_sketchy_refuses_says_memory_made_it_sketchy():
    with pytest.raises(ValueError, match=r"root_inverse.*memory='sketch' makes the Shampoo "
                                         r"groups preconditioner='sketchy'"):
        make_optimizer(tiny_gpt2(), lr=1e-3, memory="sketch", root_inverse="newton")


def test_an_override_that_keeps_a_long_side_diagonal_keeps_shampoo():
    optimizer = make_optimizer(tiny_gpt2(), lr=1e-3, memory="sketch", sketch_rank=RANK,
                               overrides={"*.c_fc.weight": {"diagonal_aspect": 4.0}})
    rows = labels(optimizer)
    assert rows["transformer.h.0.mlp.c_fc.weight"] == "shampoo (dim 1 diagonal)"
    assert rows["transformer.h.0.mlp.c_proj.weight"].startswith("sketchy")


def test_muon_preset_keeps_its_kinds():
    full = labels(make_optimizer(tiny_gpt2(), "muon", lr=1e-3))
    assert labels(make_optimizer(tiny_gpt2(), "muon", lr=1e-3, memory="sketch")) == full
    assert not any(v.startswith(("shampoo", "sketchy")) for v in full.values())


def test_trainer_optim_args_memory_sketch(tmp_path):
    import hf_shampoo.integrations.transformers as hft

    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, report_to=[], optim="distributed_shampoo",
        optim_args=f"memory=sketch,sketch_rank={RANK},max_preconditioner_dim=64")
    assert hft.parse_optim_args(args.optim_args).memory == "sketch"
    assert hft.parse_optim_args("lr=0.1").memory == "full"
    assert "memory" in hft.valid_keys()
    model = tiny_gpt2()
    optimizer = hft.create_optimizer(model, args)
    rows = {row["name"]: row["preconditioner"] for row in describe_rows(optimizer)}
    assert rows["transformer.h.0.mlp.c_fc.weight"] == f"sketchy (rank {RANK} on dims 0,1)"
    assert rows["transformer.h.0.ln_1.weight"] == "diagonal"
    one_step(model, optimizer)
    # without a model (the Trainer's own two groups): the optimizer's keyword
    _, kwargs = hft.optimizer_cls_and_kwargs(args)
    assert kwargs["preconditioner"] == "sketchy"
    with pytest.raises(ValueError, match=r"optim_args memory='sketchy'.*did you mean 'sketch'"):
        hft.parse_optim_args("memory=sketchy")
    # a combination memory=sketch refuses fails when the Trainer is built, before training
    bad = transformers.TrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, report_to=[], optim="distributed_shampoo",
        optim_args="memory=sketch,preconditioner=eigenvalue_corrected")
    with pytest.raises(ValueError, match="memory='sketch' with preconditioner="
                                         "'eigenvalue_corrected'"):
        hft.validate_args(bad)


def test_statistics_frequency_goes_to_the_sketched_groups_alone(tmp_path):
    """``statistics_frequency`` with ``memory="sketch"`` says how often the sketches take the
    gradient: the sketchy groups get it, the Adam and diagonal-long-side groups (which it
    would refuse) do not; through the Trainer as well; a non-divisor of the refresh period
    is refused naming it."""
    model, optimizer = build(tiny_gpt2, "sketch", precondition_frequency=10,
                             statistics_frequency=5)
    every = {g["preconditioner"]: g["statistics_frequency"] for g in optimizer.param_groups}
    assert every["sketchy"] == 5 and every["diagonal"] is None
    for _ in range(3):
        one_step(model, optimizer)
    with pytest.raises(ValueError, match=r"statistics_frequency=3.*divisor of "
                                         r"precondition_frequency \(10\)"):
        build(tiny_gpt2, "sketch", precondition_frequency=10, statistics_frequency=3)
    import hf_shampoo.integrations.transformers as hft

    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, report_to=[], optim="distributed_shampoo",
        optim_args=f"memory=sketch,sketch_rank={RANK},statistics_frequency=2,"
                   "precondition_frequency=10")
    trained = hft.create_optimizer(tiny_gpt2(), args)
    assert {g["preconditioner"]: g["statistics_frequency"] for g in trained.param_groups
            }["sketchy"] == 2
    bad = transformers.TrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, report_to=[], optim="distributed_shampoo",
        optim_args="memory=sketch,statistics_frequency=3,precondition_frequency=10")
    with pytest.raises(ValueError, match="statistics_frequency=3"):
        hft.validate_args(bad)


def test_memory_sketch_with_4bit_keeps_the_sketches_in_4_bits():
    """``memory="sketch", quantization="4bit"``: the sketched groups keep their bases in 4
    bits (smaller state than 32-bit sketches), the groups left unsketched keep 4-bit
    factors, and it trains."""
    model, four = build(tiny_gpt2, "sketch", quantization="4bit")
    other, thirty_two = build(tiny_gpt2, "sketch")
    assert labels(four) == labels(thirty_two)
    one_step(model, four)
    one_step(other, thirty_two)
    state = {k for entry in four.state_dict()["state"].values() for k in entry}
    assert any(k.endswith("sketch_basis_0_codes") for k in state)
    assert not any(k.endswith("sketch_basis_0") for k in state)
    assert (four.metrics()["optimizer/state_bytes"]
            < thirty_two.metrics()["optimizer/state_bytes"])
