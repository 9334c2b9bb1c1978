"""The module rules on tiny configs of the model families users train: for every
family and every preset, the role each parameter is given (found from the model, not from
sizes) and the kind it gets: under ``muon``, embeddings of any shape, every head, routers,
norms and biases by Adam, hidden matrices by spectral descent, fused experts per expert.

The expected roles are written out here per family, by name, independently of the rules.
"""

from __future__ import annotations

import re

import pytest
import torch
import transformers as hf

from hf_shampoo.describe_table import describe_rows
from hf_shampoo.factory import make_optimizer
from hf_shampoo.model_rules import PRESETS, WHOLE_MATRIX, param_groups, walk

pytestmark = pytest.mark.integrations

LM = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
          num_attention_heads=4, num_key_value_heads=2)
BERT = dict(vocab_size=100, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
            intermediate_size=48, max_position_embeddings=20)
MOE = dict(num_experts_per_tok=2, bos_token_id=0, eos_token_id=0, pad_token_id=0)

FAMILIES = {
    "llama": lambda: hf.LlamaForCausalLM(hf.LlamaConfig(**LM)),
    "llama_seq_cls": lambda: hf.LlamaForSequenceClassification(
        hf.LlamaConfig(**LM, num_labels=3, pad_token_id=0)),
    "qwen2": lambda: hf.Qwen2ForCausalLM(hf.Qwen2Config(**LM)),
    "qwen3": lambda: hf.Qwen3ForCausalLM(hf.Qwen3Config(**LM, head_dim=8)),
    "gpt2": lambda: hf.GPT2LMHeadModel(hf.GPT2Config(
        n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=16, bos_token_id=0,
        eos_token_id=0)),
    "bert_seq_cls": lambda: hf.BertForSequenceClassification(hf.BertConfig(**BERT, num_labels=3)),
    # the vocabulary size equals the intermediate size: a size guess would misfire here
    "bert_vocab_128": lambda: hf.BertForSequenceClassification(hf.BertConfig(
        **{**BERT, "vocab_size": 128, "intermediate_size": 128}, num_labels=3)),
    "bert_token_cls": lambda: hf.BertForTokenClassification(hf.BertConfig(**BERT, num_labels=5)),
    "t5": lambda: hf.T5ForConditionalGeneration(hf.T5Config(
        vocab_size=64, d_model=32, d_kv=8, d_ff=48, num_layers=1, num_heads=4)),
    "t5_untied": lambda: hf.T5ForConditionalGeneration(hf.T5Config(
        vocab_size=64, d_model=32, d_kv=8, d_ff=48, num_layers=1, num_heads=4,
        tie_word_embeddings=False)),
    "vit": lambda: hf.ViTForImageClassification(hf.ViTConfig(
        image_size=16, patch_size=4, hidden_size=32, num_hidden_layers=1,
        num_attention_heads=2, intermediate_size=48, num_labels=4)),
    "mixtral": lambda: hf.MixtralForCausalLM(hf.MixtralConfig(
        **LM, num_local_experts=4, **MOE)),
    "qwen2_moe": lambda: hf.Qwen2MoeForCausalLM(hf.Qwen2MoeConfig(
        **LM, moe_intermediate_size=24, shared_expert_intermediate_size=48, num_experts=4,
        **MOE)),
}

# name pattern -> expected label, first match wins; anything else is a hidden "matrix".
# Labels: "table" (an nn.Embedding: role "embedding" with its rows as index dim), "embedding"
# (a patch projection or bare embedding parameter), "lm_head" (the output projection: role
# "head" with the vocabulary as index dim), "head" (a task head), "router", "experts" (a
# fused experts weight: role "matrix", one matrix per expert), "norm", "bias", "vector".
COMMON = [(r"\.bias$", "bias"), (r"(norm|norm_\w+|ln_\d|ln_f|LayerNorm)\.weight$", "norm")]
EXPECTED = {
    "llama": [(r"embed_tokens", "table"), (r"^lm_head", "lm_head")],
    "llama_seq_cls": [(r"embed_tokens", "table"), (r"^score\.weight", "head")],
    "qwen2": [(r"embed_tokens", "table"), (r"^lm_head", "lm_head")],
    "qwen3": [(r"embed_tokens", "table"), (r"^lm_head", "lm_head")],
    "gpt2": [(r"transformer\.(wte|wpe)\.", "table")],  # lm_head is tied to wte: listed once
    "bert_seq_cls": [(r"_embeddings\.weight$", "table"), (r"^classifier\.weight", "head")],
    "bert_vocab_128": [(r"_embeddings\.weight$", "table"), (r"^classifier\.weight", "head"),
                       (r"(intermediate|output)\.dense\.weight", "matrix")],
    "bert_token_cls": [(r"_embeddings\.weight$", "table"), (r"^classifier\.weight", "head")],
    "t5": [(r"^shared\.", "table"), (r"relative_attention_bias", "table")],
    "t5_untied": [(r"^shared\.", "table"), (r"relative_attention_bias", "table"),
                  (r"^lm_head", "lm_head")],
    "vit": [(r"embeddings\.(cls_token|position_embeddings)$", "embedding"),
            (r"patch_embeddings\.projection\.weight", "embedding"),
            (r"^classifier\.weight", "head")],
    "mixtral": [(r"embed_tokens", "table"), (r"^lm_head", "lm_head"),
                (r"mlp\.gate\.weight", "router"), (r"experts\.(gate_up|down)_proj$", "experts")],
    "qwen2_moe": [(r"embed_tokens", "table"), (r"^lm_head", "lm_head"),
                  (r"mlp\.gate\.weight", "router"),
                  (r"experts\.(gate_up|down)_proj$", "experts"),
                  (r"shared_expert_gate\.weight", "vector")],
}
ROLE_OF_LABEL = {"table": "embedding", "lm_head": "head", "experts": "matrix"}
ADAM_LABELS = ("table", "embedding", "lm_head", "head", "router", "norm", "bias", "vector")


def label(family: str, name: str) -> str:
    for pattern, value in EXPECTED[family] + COMMON:
        if re.search(pattern, name):
            return value
    return "matrix"


def expected_kind(preset: str, label_: str, shape: tuple[int, ...]) -> dict:
    """What each preset gives a parameter of this label (docs/transformers.md's table)."""
    if preset == "muon":
        if label_ in ADAM_LABELS:
            return {"preconditioner": "diagonal", "grafting": "adam"}
        return {"preconditioner": "spectral_descent", "max_preconditioner_dim": WHOLE_MATRIX,
                "grafting": None}
    vector_like = sum(d > 1 for d in shape) <= 1
    if preset in ("transformer", "cnn") and (label_ in ("bias", "norm", "vector") or vector_like):
        return {"preconditioner": "diagonal"}
    index_dim = label_ == "table" or (label_ == "lm_head" and preset == "transformer")
    override = {2: {0: 0}} if index_dim else None
    return {"preconditioner": "shampoo", "inverse_exponent_override": override}


@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_gets_roles_and_kinds_from_the_model(family, preset):
    torch.manual_seed(0)
    model = FAMILIES[family]()
    labels = {info.name: label(family, info.name) for info in walk(model)}
    roles = {info.name: info.role for info in walk(model)}
    for name, expected in labels.items():
        assert roles[name] == ROLE_OF_LABEL.get(expected, expected), (name, expected)
    # max_preconditioner_dim=16: no table is small enough to be merged into one dim
    groups = param_groups(model, preset, defaults={"max_preconditioner_dim": 16})
    seen = 0
    for group in groups:
        for name, param in group["params"]:
            seen += 1
            lab = labels[name]
            experts = lab == "experts"
            assert bool(group.get("experts")) == experts, name
            unit = tuple(param.shape[1:]) if experts else tuple(param.shape)
            for key, value in expected_kind(preset, lab, unit).items():
                assert group.get(key, None if key != "preconditioner" else "shampoo") == value, \
                    (name, lab, key, group.get(key))
    assert seen == len(labels) == len({id(p) for p in model.parameters()})


@pytest.mark.parametrize("family", ["vit", "mixtral", "bert_vocab_128"])
def test_describe_shows_the_role_found(family):
    model = FAMILIES[family]()
    rows = {r["name"]: r for r in describe_rows(make_optimizer(model, "muon", lr=1e-3))}
    for name, row in rows.items():
        lab = label(family, name)
        assert row["role"] == ROLE_OF_LABEL.get(lab, lab), name
        expected = "spectral_descent" if lab in ("matrix", "experts") else "diagonal"
        assert row["preconditioner"] == expected, name
        if lab == "experts":
            assert row["blocks"].startswith("4 experts, each 1x("), row["blocks"]
