"""Progressive unfreezing, as torch documents ``add_param_group`` for it: layers frozen when
``make_optimizer`` runs are left out, and added later with plain tensors (torch's own rule
refuses an unnamed group beside named ones; ``make_optimizer``'s are named)."""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn

from hf_shampoo import DistributedShampoo, make_optimizer

pytestmark = pytest.mark.unit

UNFREEZE_AT = 3  # the first three steps train the head only


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 16), nn.LayerNorm(16), nn.ReLU(), nn.Linear(16, 5))


def _batches(steps: int):
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(24, 12, generator=gen), torch.randint(0, 5, (24,), generator=gen))
            for _ in range(steps)]


def _step(model, opt, x, y) -> None:
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()


def _frozen_body(model) -> list[nn.Parameter]:
    body = list(model[0].parameters()) + list(model[1].parameters())
    for p in body:
        p.requires_grad_(False)
    return body


def _unfrozen_later(steps: int, save_at: int | None = None):
    """make_optimizer over the head, the body unfrozen and added at ``UNFREEZE_AT``;
    optionally saved at ``save_at`` and resumed by a fresh model and optimizer."""
    model = _model()
    body = _frozen_body(model)
    opt = make_optimizer(model, lr=1e-2, precondition_frequency=2)
    batches = _batches(steps)
    for t, (x, y) in enumerate(batches):
        if t == UNFREEZE_AT:
            for p in body:
                p.requires_grad_(True)
            opt.add_param_group({"params": body, "lr": 5e-3})
        if t == save_at:
            saved = io.BytesIO()
            torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, saved)
            saved.seek(0)
            checkpoint = torch.load(saved, weights_only=True)
            model = _model()  # a new process: the model built as before, then unfrozen
            model.load_state_dict(checkpoint["model"])
            body = _frozen_body(model)
            opt = make_optimizer(model, lr=1e-2, precondition_frequency=2)
            for p in body:
                p.requires_grad_(True)
            opt.add_param_group({"params": body, "lr": 5e-3})
            opt.load_state_dict(checkpoint["opt"])
        _step(model, opt, x, y)
    return model, opt


def test_a_layer_unfrozen_later_trains_and_keeps_its_names():
    torch.set_num_threads(1)
    before = _model()
    model, opt = _unfrozen_later(8)
    assert not torch.equal(model[0].weight, before[0].weight)
    assert not torch.equal(model[1].bias, before[1].bias)
    added = opt.param_groups[-1]
    assert added["param_names"] == ["0.weight", "0.bias", "1.weight", "1.bias"]
    assert added["lr"] == 5e-3
    blocks = {b["param_index"] for b in opt.describe_blocks()}
    assert len(blocks) == sum(len(g["params"]) for g in opt.param_groups)


def test_the_added_group_is_a_new_optimizer_from_the_step_it_was_added():
    """As in torch, where unfrozen parameters get fresh state: the added group counts its
    own steps (bias correction, the start of preconditioning) from when it was added. The
    run equals the head's optimizer beside a second optimizer built over the body at
    ``UNFREEZE_AT``, bit for bit."""
    torch.set_num_threads(1)
    got, opt = _unfrozen_later(8)
    assert opt.param_groups[-1]["step"] == 8 - UNFREEZE_AT
    assert opt.param_groups[0]["step"] == 8
    model = _model()
    body = _frozen_body(model)
    head = make_optimizer(model, lr=1e-2, precondition_frequency=2)
    optimizers = [head]
    for t, (x, y) in enumerate(_batches(8)):
        if t == UNFREEZE_AT:
            for p in body:
                p.requires_grad_(True)
            names = ["0.weight", "0.bias", "1.weight", "1.bias"]
            defaults = {k: v for k, v in head.defaults.items() if k != "lr"}
            optimizers.append(DistributedShampoo(list(zip(names, body)), lr=5e-3, **defaults))
        for o in optimizers:
            o.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        for o in optimizers:
            o.step()
    for a, b in zip(got.parameters(), model.parameters()):
        assert torch.equal(a, b)


def test_a_run_saved_after_unfreezing_resumes_exactly():
    torch.set_num_threads(1)
    whole, _ = _unfrozen_later(8)
    resumed, _ = _unfrozen_later(8, save_at=5)
    for a, b in zip(resumed.parameters(), whole.parameters()):
        assert torch.equal(a, b)


def test_plain_tensors_beside_named_groups_get_positional_names():
    a, b = nn.Parameter(torch.randn(4, 3)), nn.Parameter(torch.randn(3))
    opt = DistributedShampoo([("a", a)], lr=0.1)
    opt.add_param_group({"params": [b]})
    assert opt.param_groups[1]["param_names"] == ["param_groups[1][0]"]
    b.grad = torch.ones(3)
    a.grad = torch.ones(4, 3)
    opt.step()
    assert not torch.equal(b, torch.zeros(3))
