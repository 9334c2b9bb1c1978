"""Train a causal language model with the HF ``Trainer`` and ``optim="distributed_shampoo"``.

By default everything is built locally, with no download: the text is the docstrings of
Python's own standard library, the tokenizer a small byte-level BPE trained on them in a
fraction of a second, and the model a tiny GPT-2 from a config. The run prints the training
loss as it goes down (about a minute on two CPU cores). ``--model NAME`` fine-tunes a
pretrained hub model instead (with its tokenizer), ``--dataset NAME`` uses a Hugging Face
dataset, ``--compare-adamw`` trains the same model with AdamW on the same batches. The
Trainer's logs carry the optimizer's health (``optimizer/...``, docs/metrics.md); ``--plot
PNG`` draws them with the loss against step (``python -m hf_shampoo.plot`` on the run's
``trainer_state.json``; needs matplotlib) and the run ends with the last values.

    python examples/finetune_transformers.py
    python examples/finetune_transformers.py --plot health.png
    python examples/finetune_transformers.py --model gpt2 --dataset wikitext \
        --dataset-config wikitext-2-raw-v1 --steps 500 --lr 5e-5
    torchrun --nproc_per_node 2 examples/finetune_transformers.py   # data parallel
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import math
import tempfile

import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    PreTrainedTokenizerFast,
    PrinterCallback,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

from hf_shampoo.describe_table import describe
from hf_shampoo.integrations import transformers as hf_transformers

# `import hf_shampoo` registers optim="distributed_shampoo" lazily; doing it explicitly here
# keeps the example independent of import order.
hf_transformers.register()

STDLIB_MODULES = (
    "abc", "argparse", "ast", "asyncio", "bisect", "calendar", "collections", "contextlib",
    "copy", "csv", "dataclasses", "datetime", "decimal", "difflib", "email.message", "enum",
    "fractions", "functools", "heapq", "http.client", "inspect", "io", "itertools", "json",
    "logging", "math", "operator", "os", "pathlib", "pickle", "pprint", "queue", "random", "re",
    "shutil", "socket", "sqlite3", "statistics", "string", "subprocess", "tarfile", "tempfile",
    "textwrap", "threading", "tokenize", "typing", "unittest", "urllib.parse",
    "xml.etree.ElementTree", "zipfile",
)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="pretrained hub model (default: tiny GPT-2)")
    p.add_argument("--dataset", default=None, help="Hugging Face dataset (default: stdlib docs)")
    p.add_argument("--dataset-config", default=None)
    p.add_argument("--split", default="train")
    p.add_argument("--text-column", default="text")
    p.add_argument("--steps", type=int, default=300, help="optimizer steps (default: 300)")
    p.add_argument("--lr", type=float, default=3e-3, help="learning rate (default: 3e-3)")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--block-size", type=int, default=64, help="tokens per training sequence")
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--warmup-steps", type=int, default=20)
    p.add_argument(
        "--optim-args",
        default="precondition_frequency=10,start_preconditioning_step=20",
        help="Shampoo keywords as in TrainingArguments.optim_args (k=v,k=v)",
    )
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-dir", default=None, help="checkpoints (default: a temp dir)")
    p.add_argument("--describe", action="store_true", help="print the per-parameter table")
    p.add_argument("--compare-adamw", action="store_true", help="also train with AdamW")
    p.add_argument("--plot", default=None, metavar="PNG",
                   help="draw the loss and the optimizer's health metrics against step")
    return p.parse_args()


# ---------------------------------------------------------------------- data
def stdlib_docstrings() -> list[str]:
    """Docstrings of standard-library modules, their public classes, functions, methods."""
    docs: dict[str, None] = {}
    for name in STDLIB_MODULES:
        module = importlib.import_module(name)
        for obj in [module] + [getattr(module, a) for a in sorted(dir(module)) if a[0] != "_"]:
            if inspect.ismodule(obj) and obj is not module:
                continue
            members = [obj]
            if inspect.isclass(obj):
                members += [v for a, v in sorted(vars(obj).items()) if a[0] != "_" and callable(v)]
            for member in members:
                doc = inspect.getdoc(member)
                if doc:
                    docs[doc] = None
    return list(docs)


def local_tokenizer(texts: list[str], vocab_size: int = 1024) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on ``texts`` (no download)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>")


def load_texts(args: argparse.Namespace) -> list[str]:
    if args.dataset is None:
        return stdlib_docstrings()
    from datasets import load_dataset

    dataset = load_dataset(args.dataset, args.dataset_config, split=args.split)
    return [t for t in dataset[args.text_column] if t and t.strip()]


def blocks_of(texts: list[str], tokenizer, block_size: int) -> list[dict[str, torch.Tensor]]:
    """Concatenate the tokenized texts (EOS between them) and cut into equal blocks."""
    ids: list[int] = []
    for text in texts:
        ids += tokenizer(text)["input_ids"] + [tokenizer.eos_token_id]
    count = len(ids) // block_size
    table = torch.tensor(ids[: count * block_size]).view(count, block_size)
    return [{"input_ids": row, "labels": row} for row in table]


# ---------------------------------------------------------------------- model
def make_model(args: argparse.Namespace, tokenizer) -> torch.nn.Module:
    torch.manual_seed(args.seed)
    if args.model is not None:
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(args.model)
    config = GPT2Config(
        vocab_size=len(tokenizer),
        n_positions=args.block_size,
        n_embd=64,
        n_layer=2,
        n_head=4,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    return GPT2LMHeadModel(config)


class LossTable(TrainerCallback):
    """Prints ``step  loss  learning rate`` rows, and keeps the losses."""

    def __init__(self, label: str) -> None:
        self.label = label
        self.losses: list[tuple[int, float]] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs and state.is_world_process_zero:
            self.losses.append((state.global_step, float(logs["loss"])))
            print(f"{self.label:>18}  {state.global_step:5d}  {logs['loss']:8.4f}  "
                  f"{logs.get('learning_rate', float('nan')):.2e}", flush=True)


def train(args, optim: str, train_set, eval_set, tokenizer, output_dir: str):
    model = make_model(args, tokenizer)
    training_args = TrainingArguments(
        output_dir=output_dir,
        optim=optim,
        optim_args=args.optim_args if optim == hf_transformers.OPTIMIZER_NAME else None,
        learning_rate=args.lr,
        weight_decay=args.weight_decay,
        warmup_steps=args.warmup_steps,
        max_steps=args.steps,
        per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=args.batch_size,
        logging_steps=args.log_every,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        seed=args.seed,
        use_cpu=not torch.cuda.is_available(),
    )
    table = LossTable(optim)
    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=train_set,
        eval_dataset=eval_set,
        callbacks=[table],
    )
    trainer.remove_callback(PrinterCallback)  # LossTable prints the losses
    if args.describe and optim == hf_transformers.OPTIMIZER_NAME:
        trainer.create_optimizer()
        if training_args.process_index == 0:
            print(describe(trainer.optimizer))
    print(f"{'optimizer':>18}  {'step':>5}  {'loss':>8}  lr")
    trainer.train()
    eval_loss = trainer.evaluate()["eval_loss"]
    health = {}
    if optim == hf_transformers.OPTIMIZER_NAME:
        health = next((h for h in reversed(trainer.state.log_history)
                       if "optimizer/steps" in h), {})
        if args.plot and training_args.process_index == 0:
            from hf_shampoo.plot import plot

            trainer.save_state()  # output_dir/trainer_state.json: its log_history
            print(f"loss and optimizer health against step: {plot(output_dir, args.plot)}")
    return table.losses, eval_loss, health


def main() -> None:
    args = parse_args()
    texts = load_texts(args)
    if args.model is None:
        tokenizer = local_tokenizer(texts)
    else:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.model)
        if tokenizer.eos_token_id is None:
            tokenizer.eos_token = tokenizer.pad_token or "</s>"
    data = blocks_of(texts, tokenizer, args.block_size)
    generator = torch.Generator().manual_seed(args.seed)
    order = torch.randperm(len(data), generator=generator).tolist()
    n_eval = max(1, len(data) // 20)
    eval_set = [data[i] for i in order[:n_eval]]
    train_set = [data[i] for i in order[n_eval:]]
    print(f"{len(texts)} texts, {len(train_set)} training / {len(eval_set)} evaluation "
          f"sequences of {args.block_size} tokens, vocabulary {len(tokenizer)}")

    runs = [hf_transformers.OPTIMIZER_NAME] + (["adamw_torch"] if args.compare_adamw else [])
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for optim in runs:
            results[optim] = train(
                args, optim, train_set, eval_set, tokenizer, args.output_dir or tmp
            )
    for optim, (losses, eval_loss, health) in results.items():
        first, last = losses[0][1], losses[-1][1]
        print(f"{optim}: training loss {first:.3f} -> {last:.3f}; evaluation loss "
              f"{eval_loss:.3f} (perplexity {math.exp(eval_loss):.1f})")
        if health:
            print(f"{optim}: optimizer health at step {health['step']} (docs/metrics.md): "
                  + ", ".join(f"{k.removeprefix('optimizer/')} {v:.3g}"
                              for k, v in health.items() if k.startswith("optimizer/")))


if __name__ == "__main__":
    main()
