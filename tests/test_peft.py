"""LoRA models (peft) through the Trainer and through Accelerate: the optimizer holds state
for the adapters only, however the parameters are passed (frozen parameters get none)."""

from __future__ import annotations

import pytest
import torch

from hf_shampoo import DistributedShampoo
from hf_shampoo.describe_table import describe_rows

pytestmark = pytest.mark.integrations

peft = pytest.importorskip("peft", reason="peft is a test extra")
transformers = pytest.importorskip("transformers")

VOCAB = 64


def lora_gpt2():
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB,
                                     n_positions=16, bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config)
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn", "c_proj"],
                           fan_in_fan_out=True, lora_dropout=0.0)
    return peft.get_peft_model(model, lora)


def batches(n=3):
    ids = torch.randint(0, VOCAB, (n, 4, 16), generator=torch.Generator().manual_seed(1))
    return [{"input_ids": b, "labels": b} for b in ids]


def state_params(optimizer) -> set[int]:
    return {id(p) for p in optimizer.state}


def adapters(model) -> set[int]:
    return {id(p) for n, p in model.named_parameters() if "lora_" in n}


def test_trainer_holds_state_for_the_adapters_only(tmp_path):
    import hf_shampoo  # noqa: F401  (registers optim="distributed_shampoo")

    model = lora_gpt2()
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, report_to=[], max_steps=3,
        per_device_train_batch_size=2, save_strategy="no", disable_tqdm=True,
        optim="distributed_shampoo", optim_args="precondition_frequency=2")
    data = [{"input_ids": row, "labels": row} for b in batches() for row in b["input_ids"]]
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
    trainer.train()
    optimizer = trainer.optimizer.optimizer if hasattr(trainer.optimizer, "optimizer") \
        else trainer.optimizer
    assert isinstance(optimizer, DistributedShampoo)
    assert state_params(optimizer) == adapters(model)
    # the presets keep each adapter's long side diagonal: at most 3x AdamW's state
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    ours = sum(r["state_bytes"] for r in optimizer.describe_blocks())
    assert ours <= 3 * 8 * trainable, (ours, 8 * trainable)
    frozen = [p for p in model.parameters() if not p.requires_grad]
    assert frozen and not any(p in optimizer.state for p in frozen)


def test_accelerate_with_all_parameters_holds_state_for_the_adapters_only():
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    model = lora_gpt2()
    base = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" not in n}
    optimizer = DistributedShampoo(model.parameters(), lr=1e-3, grafting="adam",
                                   precondition_frequency=2)  # the usual: every parameter
    model, optimizer = accelerator.prepare(model, optimizer)
    for batch in batches():
        optimizer.zero_grad()
        accelerator.backward(model(**batch).loss)
        optimizer.step()
    inner = optimizer.optimizer
    unwrapped = accelerator.unwrap_model(model)
    assert state_params(inner) == adapters(unwrapped)
    rows = describe_rows(inner)  # one per parameter, in the order they were passed
    assert [r["frozen"] for r in rows] == ["lora_" not in n for n, _ in
                                           unwrapped.named_parameters()]
    assert all(torch.equal(p, base[n]) for n, p in unwrapped.named_parameters()
               if "lora_" not in n)  # the frozen model did not move


def test_an_override_gives_adapters_full_factors():
    """The presets' adapter rule is a memory choice: ``diagonal_aspect=None`` for the
    adapters (the documented override, also as ``optim_args``) gives them full factors."""
    from hf_shampoo.factory import make_optimizer
    from hf_shampoo.integrations.transformers.arguments import parse_optim_args

    model = lora_gpt2()
    parsed = parse_optim_args("*lora_*@diagonal_aspect=None")
    full = make_optimizer(model, overrides=parsed.overrides, grafting="adam")
    lean = make_optimizer(model, grafting="adam")
    rows = {r["name"]: r["preconditioner"] for r in describe_rows(full) if "lora_A" in r["name"]}
    assert rows and all(kind == "shampoo" for kind in rows.values())
    assert all("diagonal" in r["preconditioner"] for r in describe_rows(lean)
               if "lora_A" in r["name"])
    state = lambda opt: sum(r["state_bytes"] for r in opt.describe_blocks())  # noqa: E731
    assert state(full) > 100 * state(lean)
