"""Tests of hf_shampoo/model_rules.py, factory.py and describe_table.py: model walk, presets,
overrides, make_optimizer, describe()."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import BertConfig, BertModel, GPT2Config, GPT2LMHeadModel, Trainer

from hf_shampoo import DistributedShampoo
from hf_shampoo.describe_table import describe, describe_rows
from hf_shampoo.factory import make_optimizer
from hf_shampoo.model_rules import guess_vocab_size, param_groups, walk

pytestmark = pytest.mark.integrations

VOCAB = 96


def tiny_gpt2(tied: bool = True) -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=1, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=40,
        tie_word_embeddings=tied, bos_token_id=0, eos_token_id=0,
    )
    return GPT2LMHeadModel(config)


def tiny_cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 10, 3),
        nn.BatchNorm2d(10),
        nn.ReLU(),
        nn.Conv2d(10, 10, 3, groups=10, bias=False),  # depthwise: (10, 1, 3, 3)
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(10, 5),
    )


def config_of(groups: list[dict], name: str) -> dict:
    for group in groups:
        names = [n for n, _ in group["params"]]
        if name in names:
            return {k: v for k, v in group.items() if k != "params"}
    raise KeyError(name)


def all_names(groups: list[dict]) -> list[str]:
    return [n for g in groups for n, _ in g["params"]]


def test_gpt2_roles_and_tied_weights_counted_once():
    model = tiny_gpt2()
    infos = {info.name: info for info in walk(model, VOCAB)}
    wte = infos["transformer.wte.weight"]
    assert "lm_head.weight" in wte.aliases and "lm_head" in wte.module_names
    assert "lm_head.weight" not in infos  # tied: once, under its first name
    assert wte.role == "embedding" and wte.vocab_dims == (0,)
    assert infos["transformer.h.0.ln_1.weight"].role == "norm"
    assert infos["transformer.h.0.attn.c_attn.bias"].role == "bias"
    assert infos["transformer.h.0.attn.c_attn.weight"].role == "matrix"

    groups = param_groups(model, "transformer", weight_decay=0.1)
    names = all_names(groups)
    assert len(names) == len(set(names)) == len(list(model.parameters()))
    assert config_of(groups, "transformer.wte.weight")["inverse_exponent_override"] == {2: {0: 0}}
    assert config_of(groups, "transformer.wpe.weight")["inverse_exponent_override"] == {2: {0: 0}}
    for name in ("transformer.h.0.ln_1.weight", "transformer.h.0.mlp.c_fc.bias"):
        assert config_of(groups, name)["preconditioner"] == "diagonal"
        assert config_of(groups, name)["weight_decay"] == 0.0
    matrix = config_of(groups, "transformer.h.0.mlp.c_fc.weight")
    assert "preconditioner" not in matrix and matrix["weight_decay"] == 0.1


def test_vocab_dim_is_dim0_of_embedding_and_untied_lm_head():
    model = tiny_gpt2(tied=False)
    assert model.transformer.wte.weight.shape[0] == VOCAB  # nn.Embedding: (vocab, hidden)
    assert model.lm_head.weight.shape[0] == VOCAB  # nn.Linear(hidden, vocab): (vocab, hidden)
    assert guess_vocab_size(model) == VOCAB
    infos = {info.name: info for info in walk(model)}  # found from the model, not the size
    assert infos["lm_head.weight"].role == "head"
    assert infos["lm_head.weight"].vocab_dims == (0,)
    groups = param_groups(model)
    assert config_of(groups, "lm_head.weight")["inverse_exponent_override"] == {2: {0: 0}}
    # a plain model names nothing: the size is the last resort, and a Linear *from* the
    # vocabulary has it in dim 1
    reader = nn.Sequential(nn.Linear(VOCAB, 40))
    (info,) = [i for i in walk(reader, VOCAB) if i.name.endswith("weight")]
    assert info.role == "vocab" and info.vocab_dims == (1,)


def test_vocab_factor_is_really_skipped_and_small_tables_go_diagonal():
    model = tiny_gpt2()
    optimizer = make_optimizer(model, lr=1e-3, grafting="adam", max_preconditioner_dim=64)
    x = torch.randint(0, VOCAB, (2, 8))
    model(input_ids=x, labels=x).loss.backward()
    optimizer.step()
    state = optimizer.state_dict()["state"]
    wte_index = 0  # first group, first parameter
    keys = {k.split(".", 1)[1] for k in state[wte_index]}
    assert "factor_matrix_1" in keys and "factor_matrix_0" not in keys
    # a (4, 8) table merges into one dim of 32 <= max_preconditioner_dim: no vocab factor left
    small = nn.Embedding(4, 8)
    (group,) = param_groups(small, defaults={"max_preconditioner_dim": 64})
    assert group["preconditioner"] == "diagonal"


def test_decay_groups_match_the_trainer():
    for model in (tiny_gpt2(), BertModel(BertConfig(
        vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=20,
    ))):
        trainer_decay = set(Trainer.get_decay_parameter_names(None, model))
        groups = param_groups(model, "transformer", weight_decay=0.5)
        ours = {n for g in groups for n, _ in g["params"] if g["weight_decay"] > 0}
        assert ours == {n for n, _ in model.named_parameters()} & trainer_decay


def test_cnn_preset_merges_kernels_and_uses_diagonal_for_vectors():
    model = tiny_cnn()
    optimizer = make_optimizer(
        model, "cnn", lr=1e-2, grafting="adam", weight_decay=1e-4, max_preconditioner_dim=128
    )
    rows = {r["name"]: r for r in describe_rows(optimizer)}
    assert rows["0.weight"]["blocks"] == "1x(10, 27)"  # (10, 3, 3, 3) merged last to first
    assert rows["3.weight"]["blocks"] == "1x(90,)"  # depthwise (10, 1, 3, 3): 90 <= 128
    assert rows["1.weight"]["preconditioner"] == "diagonal"
    assert rows["0.bias"]["preconditioner"] == "diagonal"
    assert rows["0.bias"]["weight_decay"] == 0 and rows["1.weight"]["weight_decay"] == 0
    assert rows["6.weight"]["preconditioner"] == "shampoo"
    x = torch.randn(4, 3, 8, 8)
    before = [p.detach().clone() for p in model.parameters()]
    for _ in range(3):
        optimizer.zero_grad()
        model(x).square().mean().backward()
        optimizer.step()
    assert all(not torch.equal(a, p) for a, p in zip(before, model.parameters()))


def test_overrides_by_pattern_later_wins():
    model = tiny_gpt2()
    groups = param_groups(
        model,
        overrides={
            "transformer.h.*.attn.*": {"max_preconditioner_dim": 16},
            "re:c_attn\\.weight$": {"preconditioner": "eigenvalue_corrected"},
            "lm_head": {"precondition_frequency": 7},  # a module name: reaches the tied weight
        },
    )
    assert config_of(groups, "transformer.h.0.attn.c_proj.weight")["max_preconditioner_dim"] == 16
    attn = config_of(groups, "transformer.h.0.attn.c_attn.weight")
    assert attn["preconditioner"] == "eigenvalue_corrected" and attn["max_preconditioner_dim"] == 16
    assert config_of(groups, "transformer.wte.weight")["precondition_frequency"] == 7
    # a bias under attn keeps the diagonal method (override did not set preconditioner)
    assert config_of(groups, "transformer.h.0.attn.c_attn.bias")["preconditioner"] == "diagonal"


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"nothing.matches": {"lr": 1.0}}, "matched no parameter"),
        ({"lm_head": {"precondition_freq": 5}}, "unknown keyword 'precondition_freq'"),
        ({"lm_head": {"precondition_frequency": 0}}, "precondition_frequency"),
        ({"lm_head": {"communication_dtype": torch.bfloat16}}, "whole optimizer"),
    ],
)
def test_bad_overrides_fail_with_clear_messages(overrides, message):
    with pytest.raises(ValueError, match=message):
        param_groups(tiny_gpt2(), overrides=overrides)


def test_unknown_preset():
    with pytest.raises(ValueError, match="unknown preset"):
        param_groups(tiny_gpt2(), preset="vit")


def test_soap_without_grafting_gives_vectors_adam():
    model = tiny_gpt2()
    groups = param_groups(model, defaults={"preconditioner": "eigenvalue_corrected"})
    norm = config_of(groups, "transformer.ln_f.weight")
    assert norm["preconditioner"] == "diagonal" and norm["grafting"] == "adam"
    optimizer = DistributedShampoo(groups, preconditioner="eigenvalue_corrected", epsilon=1e-8)
    x = torch.randint(0, VOCAB, (2, 8))
    model(input_ids=x, labels=x).loss.backward()
    optimizer.step()


def test_describe_table():
    model = tiny_gpt2()
    optimizer = make_optimizer(model, lr=1e-3, grafting="adam", max_preconditioner_dim=64)
    text = describe(optimizer)
    header = text.splitlines()[0].split()
    assert header == ["name", "shape", "role", "blocks", "preconditioner", "grafting", "wd",
                      "rank", "state"]
    assert "transformer.wte.weight" in text and "lm_head.weight" not in text
    assert "shampoo (dim 0 off)" in text
    wte = next(r for r in describe_rows(optimizer) if r["name"] == "transformer.wte.weight")
    assert wte["shape"] == (VOCAB, 32) and wte["blocks"] == "1x(64, 32) + 1x(32, 32)"
    assert wte["rank"] == "0" and wte["role"] == "embedding"
    ln = next(r for r in describe_rows(optimizer) if r["name"] == "transformer.ln_f.weight")
    assert ln["role"] == "norm"
    assert text.splitlines()[-3].startswith(f"{len(list(model.parameters()))} parameters")
    assert text.splitlines()[-2] == "blocks spread over one process"
    assert text.splitlines()[-1].startswith("optimizer state per rank: rank 0: ")
    with pytest.raises(TypeError):
        describe(torch.optim.SGD(model.parameters(), lr=0.1))


@pytest.mark.parametrize("quantization", [None, "4bit"])
def test_described_state_bytes_are_what_a_step_allocates(quantization):
    """describe()'s state per rank, known before training, equals the bytes of the state
    tensors the first steps allocate."""
    model = tiny_gpt2()
    optimizer = make_optimizer(model, lr=1e-3, grafting="adam", max_preconditioner_dim=64,
                               quantization=quantization, precondition_frequency=2)
    promised = sum(b["state_bytes"] for b in optimizer.describe_blocks())
    for _ in range(2):
        x = torch.randint(0, VOCAB, (2, 8))
        optimizer.zero_grad()
        model(input_ids=x, labels=x).loss.backward()
        optimizer.step()
    allocated = sum(t.numel() * t.element_size() for stack in optimizer._ensure_layout().owned
                    for t in stack.state.values())
    assert promised == allocated
    assert f"rank 0: {promised / 2**10:.1f} KiB" in describe(optimizer).splitlines()[-1]
