"""Views of the parameters, never of the gradients: weight decay reads the parameters
through views (``param_rows``, ``update_rules.add_rows``), the same bits as decay from a stack;
the step stacks a copy of the gradients and never touches ``p.grad`` (torch's contract):
after any number of steps each gradient is the same tensor, with the same ``_version`` and
values, for Shampoo, SOAP, the Muon recipe and L2 decay, with gradients kept between steps
(``zero_grad(set_to_none=False)``) or fresh ones, in one process and under 2-rank DDP; kept
gradients train bit for bit as fresh ones."""

import os
import tempfile

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn as nn

from hf_shampoo import DistributedShampoo, update_rules
from tests.helpers import TEST_DEVICE, assert_bitwise, join_gloo_world, leave_gloo_world

MUON = dict(preconditioner="spectral_descent", betas=(0.95, 1.0), beta3=0.95**2,
            use_bias_correction=False, weight_decay=0.1,
            spectral_lr_adjustment="match_rms_adamw", newton_schulz_dtype=torch.bfloat16,
            max_preconditioner_dim=2**31 - 1, lr=0.02)
SHAMPOO = dict(grafting="adam", weight_decay=0.01, momentum=0.9, nesterov=True, lr=0.01,
               precondition_frequency=2, start_preconditioning_step=2,
               max_preconditioner_dim=256)
SOAP = dict(preconditioner="eigenvalue_corrected", weight_decay=0.01, lr=0.003,
            precondition_frequency=2, max_preconditioner_dim=256, epsilon=1e-8)


@pytest.mark.unit
@pytest.mark.parametrize("shapes", [[(300, 200)] * 3, [(7,)] * 40 + [(7,)], [(5, 3)] * 9])
def test_decay_from_views_equals_decay_from_a_stack(shapes):
    """``add_rows`` adds the parameters straight from their views, a large block alone and
    small ones in groups: the same bits as adding their stack."""
    gen = torch.Generator().manual_seed(0)
    rows = [torch.randn(s, generator=gen) for s in shapes]
    target = torch.randn((len(rows), *shapes[0]), generator=gen)
    expected = target.clone().add_(torch.stack(rows), alpha=0.1)
    update_rules.add_rows(target, rows, 0.1)
    assert torch.equal(target, expected)
    groups = list(update_rules.row_groups(rows))
    assert [i for a, b in groups for i in range(a, b)] == list(range(len(rows)))


def _model(seed=0, device="cpu"):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(96, 160, bias=False), nn.GELU(),
                         nn.Linear(160, 160, bias=False), nn.GELU(),
                         nn.Linear(160, 160, bias=False), nn.GELU(),
                         nn.Linear(160, 10, bias=False)).to(device)


def _train(config, set_to_none, steps=6, unused_at=3, device="cpu"):
    """Trains on fixed batches, checking after every step that each gradient is the tensor
    backward left (with ``set_to_none=False``: the one of the first backward), unchanged in
    ``_version`` and values; at step ``unused_at`` the third layer gets no gradient (its
    stack's other block does)."""
    model = _model(device=device)
    opt = DistributedShampoo(model.parameters(), **config)
    gen = torch.Generator().manual_seed(1)
    first = None
    for step in range(steps):
        x = torch.randn(32, 96, generator=gen, device="cpu").to(device)
        opt.zero_grad(set_to_none=set_to_none)
        if step == unused_at:
            model[4].weight.grad = None
            model[6](model[5](model[:4](x))).square().mean().backward()
        else:
            model(x).square().mean().backward()
        _step_leaves_gradients_alone(model, opt)
        # the layer whose gradient the loop set to None has a new one after
        grads = [p.grad for p in model.parameters() if p is not model[4].weight]
        first = first or grads
        if not set_to_none:
            assert all(a is b for a, b in zip(grads, first)), "a gradient was replaced"
    return model, opt


def _step_leaves_gradients_alone(model, opt):
    """One ``opt.step()``, and the assertion that every ``p.grad`` is the tensor it was
    before, with the same ``_version`` and values."""
    grads = [p.grad for p in model.parameters()]
    seen = [None if g is None else (g._version, g.clone()) for g in grads]
    opt.step()
    for p, grad, before in zip(model.parameters(), grads, seen):
        assert p.grad is grad, "the step replaced a gradient"
        if grad is not None:
            assert grad._version == before[0], "the step wrote into a gradient"
            assert torch.equal(grad, before[1]), "the step changed a gradient"


@pytest.mark.unit
@pytest.mark.device
@pytest.mark.parametrize("config", [MUON, SHAMPOO, SOAP, dict(SHAMPOO, weight_decay_type="l2")],
                         ids=["muon", "shampoo", "soap", "shampoo_l2"])
def test_kept_gradients_train_as_fresh_ones_and_stay_the_users(config):
    """``zero_grad(set_to_none=False)``: every gradient stays the user's one tensor, which
    the step only reads, and every number equals a run whose gradients are fresh each
    step."""
    kept, _ = _train(config, set_to_none=False, device=TEST_DEVICE)
    fresh, _ = _train(config, set_to_none=True, device=TEST_DEVICE)
    assert_bitwise(list(kept.parameters()), list(fresh.parameters()))
    assert all(p.grad._base is None for p in kept.parameters())


@pytest.mark.unit
def test_no_layout_touches_a_gradient():
    """A channels_last weight, one cut into several blocks, a bfloat16 gradient of a float32
    stack, a gradient that is a view of someone else's buffer (a DDP bucket) and a plain
    one: after steps each ``p.grad`` is the same tensor, version and values."""
    conv = nn.Conv2d(3, 8, 3).to(memory_format=torch.channels_last)
    big = nn.Parameter(torch.randn(300, 40))  # cut into blocks of 128 rows
    half = nn.Parameter(torch.randn(40, 30, dtype=torch.bfloat16))
    plain = nn.Parameter(torch.randn(37, 30))
    bucketed = nn.Parameter(torch.randn(41, 30))
    bucket = torch.zeros(41 * 30 + 5)
    params = [conv.weight, conv.bias, big, half, plain, bucketed]
    opt = DistributedShampoo(params, grafting="adam", max_preconditioner_dim=128, lr=0.01,
                             precondition_frequency=2, start_preconditioning_step=2)
    for p in params[:-1]:
        p.grad = torch.randn_like(p)
    bucketed.grad = bucket[5:].view(41, 30)
    bucketed.grad.normal_()
    grads = [p.grad for p in params]
    for _ in range(4):
        seen = [(g._version, g.clone()) for g in grads]
        opt.step()
        assert all(p.grad is g for p, g in zip(params, grads))
        assert [g._version for g in grads] == [v for v, _ in seen]
        assert_bitwise(grads, [c for _, c in seen])
    assert bucketed.grad._base is bucket and all(g._base is None for g in grads[:-1])


@pytest.mark.unit
def test_a_switch_to_l2_decay_leaves_the_gradients_alone():
    """L2 decay switched on between steps writes into the stacked copy, never into
    ``p.grad``: kept and fresh gradients give the same numbers."""
    x = torch.randn(8, 96, generator=torch.Generator().manual_seed(2))
    runs = []
    for set_to_none in (False, True):
        model = _model()
        opt = DistributedShampoo(model.parameters(), **SHAMPOO)
        for step in range(5):
            if step == 3:
                for group in opt.param_groups:
                    group["weight_decay_type"] = "l2"
            opt.zero_grad(set_to_none=set_to_none)
            model(x).square().mean().backward()
            _step_leaves_gradients_alone(model, opt)
        runs.append(list(model.parameters()))
    assert_bitwise(*runs)


def _ddp_worker(rank, world, init_file, out_dir, set_to_none):
    join_gloo_world(rank, world, init_file)
    model = _model()
    opt = DistributedShampoo(model.parameters(), distributed="ddp", **MUON)
    gen = torch.Generator().manual_seed(1)
    first = None
    for _ in range(4):
        x = torch.randn(32, 96, generator=gen)  # the same batch on every rank
        opt.zero_grad(set_to_none=set_to_none)
        model(x).square().mean().backward()
        _step_leaves_gradients_alone(model, opt)
        first = first or [p.grad for p in model.parameters()]
        if not set_to_none:
            assert all(p.grad is g for p, g in zip(model.parameters(), first))
    torch.save([p.detach() for p in model.parameters()], os.path.join(out_dir, f"{rank}.pt"))
    leave_gloo_world()


@pytest.mark.distributed
@pytest.mark.parametrize("set_to_none", [False, True], ids=["kept", "fresh"])
def test_ddp_leaves_gradients_alone_and_equals_one_process(set_to_none):
    """2 ranks: every rank's gradients are the user's, untouched by the step; the
    parameters equal one process's, kept or fresh gradients."""
    torch.set_num_threads(1)
    model = _model()
    opt = DistributedShampoo(model.parameters(), **MUON)
    gen = torch.Generator().manual_seed(1)
    for _ in range(4):
        x = torch.randn(32, 96, generator=gen)
        opt.zero_grad(set_to_none=set_to_none)
        model(x).square().mean().backward()
        opt.step()
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_ddp_worker, args=(2, os.path.join(out_dir, "init"), out_dir, set_to_none),
                 nprocs=2)
        for rank in range(2):
            assert_bitwise(torch.load(os.path.join(out_dir, f"{rank}.pt")),
                           [p.detach() for p in model.parameters()])
