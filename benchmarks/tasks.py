"""The small training tasks the convergence benchmarks share: their data (bundled or
generated, no download; a Hugging Face dataset by name or saved directory as an
alternative) and their models, built from a seed.

- ``digits``: scikit-learn's 8×8 digits, upsampled, for an MLP, a small CNN or a small
  timm ResNet (BasicBlocks, one per stage).
- ``text``: the bytes of Python's own standard-library sources for a byte-level GPT-2
  (transformers' ``GPT2LMHeadModel`` from a small config).
- ``docstrings``: the docstrings of the same modules (English prose, where the sources are
  mostly code), the fine-tuning data of the LoRA task; ``make_lora`` puts peft's LoRA
  adapters on a copy of a trained GPT-2.
"""

from __future__ import annotations

import ast
import copy
import functools
import os
import pathlib
import sysconfig

import torch
from torch import nn

from hf_shampoo.optional import require

CONTEXT = 128  # tokens per GPT-2 training window


# ------------------------------------------------------------------------------ images
def digits_split(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """scikit-learn's digits as flat 64-value rows in [0, 1]: 80 % train, 20 % test, split
    by ``seed``."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target, dtype=torch.long)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    n_train = int(0.8 * len(y))
    return x[perm[:n_train]], y[perm[:n_train]], x[perm[n_train:]], y[perm[n_train:]]


def upsample(x: torch.Tensor, size: int) -> torch.Tensor:
    """Flat 8×8 rows (or images of any size, N×C×H×W) to N×C×size×size, bilinear."""
    if x.dim() == 2:
        x = x.view(-1, 1, 8, 8)
    return nn.functional.interpolate(x, size=(size, size), mode="bilinear", align_corners=False)


@functools.cache
def image_dataset(name: str | None, size: int, seed: int = 0):
    """(train images, train labels, test images, test labels, classes), images N×1×size×size.

    ``name`` None: digits upsampled from 8×8. Otherwise a Hugging Face dataset by name
    (``datasets.load_dataset``) or a directory written by ``Dataset(Dict).save_to_disk``,
    with an image column (``image``/``img``) and a label column (``label``/``labels``);
    its ``test`` split (else ``validation``, else the last 20 % of ``train``) is the test
    set. Images are converted to grayscale and resized."""
    if name is None:
        x, y, xt, yt = digits_split(seed)
        return upsample(x, size), y, upsample(xt, size), yt, 10
    train, test = _hf_splits(name)
    image_key = _column(train, ("image", "img"), name)
    label_key = _column(train, ("label", "labels"), name)

    def tensors(split):
        import numpy as np

        images = [np.asarray(im.convert("L").resize((size, size))) for im in split[image_key]]
        x = torch.tensor(np.stack(images), dtype=torch.float32).unsqueeze(1) / 255.0
        return x, torch.tensor(split[label_key], dtype=torch.long)

    x, y = tensors(train)
    xt, yt = tensors(test)
    return x, y, xt, yt, int(max(y.max(), yt.max())) + 1


def make_resnet(seed: int, classes: int = 10) -> nn.Module:
    """timm's ResNet with one BasicBlock per stage and widths 16/32/64/128 (0.32M
    parameters), one input channel."""
    from timm.models.resnet import BasicBlock, ResNet

    torch.manual_seed(seed)
    return ResNet(BasicBlock, (1, 1, 1, 1), num_classes=classes, in_chans=1,
                  channels=(16, 32, 64, 128), stem_width=16)


def classification_parts(x: torch.Tensor, y: torch.Tensor, xt: torch.Tensor, yt: torch.Tensor,
                         batch_size: int):
    """``(batches, loss, evaluate)`` of an image classification task: random training
    batches (fixed by the seed), the cross-entropy, test accuracy and loss in eval mode."""

    def batches(seed: int, steps: int) -> list:
        g = torch.Generator().manual_seed(seed + 1)
        return [torch.randint(0, len(y), (batch_size,), generator=g) for _ in range(steps)]

    def loss(model, index):
        return nn.functional.cross_entropy(model(x[index]), y[index])

    def evaluate(model) -> dict[str, float]:
        model.eval()
        with torch.no_grad():
            logits = model(xt)
        model.train()
        return {"test acc": (logits.argmax(1) == yt).float().mean().item(),
                "test loss": nn.functional.cross_entropy(logits, yt).item()}

    return batches, loss, evaluate


def make_digits_model(kind: str, seed: int) -> nn.Module:
    """The MLP or small CNN on flat 8×8 digits (``convergence.py``)."""
    torch.manual_seed(seed)
    if kind == "mlp":
        return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(),
                             nn.Linear(128, 10))
    return nn.Sequential(nn.Unflatten(1, (1, 8, 8)), nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(),
                         nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Flatten(), nn.Linear(32 * 16, 64), nn.ReLU(), nn.Linear(64, 10))


# -------------------------------------------------------------------------------- text
@functools.cache
def text_tokens(name: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(train bytes, validation bytes) as int64 tensors.

    ``name`` None: Python's standard-library sources, the first 150 top-level modules by
    name for training and the next 30 for validation. Otherwise a Hugging Face dataset by
    name or saved directory with a ``text`` column (its ``validation``/``test`` split, else
    the last 10 % of ``train``, for validation), documents joined by newlines."""
    if name is None:
        files = _stdlib_modules()
        train = b"".join(path.read_bytes() for path in files[:150])
        val = b"".join(path.read_bytes() for path in files[150:180])
    else:
        train_split, val_split = _hf_splits(name, holdout=0.1)
        key = _column(train_split, ("text", "content"), name)
        train = "\n".join(train_split[key]).encode()
        val = "\n".join(val_split[key]).encode()
    as_tensor = lambda data: torch.frombuffer(bytearray(data), dtype=torch.uint8).long()  # noqa: E731
    return as_tensor(train), as_tensor(val)


def _stdlib_modules() -> list[pathlib.Path]:
    return sorted(pathlib.Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))


def _docstrings(path: pathlib.Path) -> bytes:
    """The module's, classes' and functions' docstrings of one source file, in order."""
    try:
        tree = ast.parse(path.read_bytes())
    except (SyntaxError, ValueError):
        return b""
    nodes = [tree] + [n for n in ast.walk(tree) if isinstance(
        n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
    texts = [ast.get_docstring(n) for n in nodes]
    return "".join(t + "\n\n" for t in texts if t).encode()


def docstring_tokens() -> tuple[torch.Tensor, torch.Tensor]:
    """(train bytes, validation bytes) of the standard library's docstrings: the modules
    that ``text_tokens`` trains on, then the ones it validates on."""
    files = _stdlib_modules()
    train = b"".join(_docstrings(path) for path in files[:150])
    val = b"".join(_docstrings(path) for path in files[150:180])
    as_tensor = lambda data: torch.frombuffer(bytearray(data), dtype=torch.uint8).long()  # noqa: E731
    return as_tensor(train), as_tensor(val)


def make_lora(base: nn.Module, seed: int, r: int = 4) -> nn.Module:
    """A copy of ``base`` with peft's LoRA adapters (rank ``r``, alpha ``2r``) on GPT-2's
    attention and projection matrices (``c_attn``, ``c_proj``); the adapters' random
    half is drawn from ``seed``, the base weights are frozen."""
    peft = require("peft", "the LoRA tasks of benchmarks.tasks")
    torch.manual_seed(seed)
    config = peft.LoraConfig(r=r, lora_alpha=2 * r, target_modules=["c_attn", "c_proj"],
                             fan_in_fan_out=True, lora_dropout=0.0)
    return peft.get_peft_model(copy.deepcopy(base), config)


def make_gpt2(seed: int, n_layer: int = 2, n_embd: int = 128) -> nn.Module:
    """A byte-level GPT-2 (vocabulary 256, context ``CONTEXT``, no dropout)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=256, n_positions=CONTEXT, n_embd=n_embd, n_layer=n_layer,
                        n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        bos_token_id=None, eos_token_id=None)
    return GPT2LMHeadModel(config)


def windows_of(tokens: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
    """Rows ``tokens[s : s + CONTEXT]`` for each start ``s``."""
    return torch.stack([tokens[s : s + CONTEXT] for s in starts.tolist()])


def language_model_parts(args, train_tokens: torch.Tensor, val_tokens: torch.Tensor):
    """``(batches, loss, evaluate)`` of a byte-level language-model task: random training
    windows (fixed by the seed), the causal LM loss, the loss on ``--val-windows`` fixed
    validation windows."""
    val_starts = torch.linspace(0, len(val_tokens) - CONTEXT - 1, args.val_windows).long()
    val_batch = windows_of(val_tokens, val_starts)

    def batches(seed: int, steps: int) -> list:
        g = torch.Generator().manual_seed(seed + 1)
        return [torch.randint(0, len(train_tokens) - CONTEXT, (args.text_batch_size,),
                              generator=g) for _ in range(steps)]

    def loss(model, starts):
        batch = windows_of(train_tokens, starts)
        return model(input_ids=batch, labels=batch).loss

    def evaluate(model) -> dict[str, float]:
        with torch.no_grad():
            return {"val loss": model(input_ids=val_batch, labels=val_batch).loss.item()}

    return batches, loss, evaluate


# ------------------------------------------------------------------ Hugging Face datasets
def _hf_splits(name: str, holdout: float = 0.2):
    import datasets

    if os.path.isdir(name):
        loaded = datasets.load_from_disk(name)
    else:
        loaded = datasets.load_dataset(name)
    if isinstance(loaded, datasets.Dataset):
        loaded = datasets.DatasetDict(train=loaded)
    if "train" not in loaded:
        raise ValueError(f"dataset {name!r} has no 'train' split (splits: {list(loaded)})")
    for held_out in ("test", "validation"):
        if held_out in loaded:
            return loaded["train"], loaded[held_out]
    parts = loaded["train"].train_test_split(test_size=holdout, shuffle=False)
    return parts["train"], parts["test"]


def _column(split, candidates: tuple[str, ...], name: str) -> str:
    for key in candidates:
        if key in split.column_names:
            return key
    raise ValueError(f"dataset {name!r} has none of the columns {list(candidates)} "
                     f"(columns: {split.column_names})")
