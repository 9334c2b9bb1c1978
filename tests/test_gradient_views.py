"""No copy where a view serves: weight decay reads the parameters through views, and
gradients become views of their stack's buffer (as DDP's buckets). Neither may change a
number: decay from views equals decay from a stack bit for bit, a step with gradients kept
between steps (``zero_grad(set_to_none=False)``) equals one with fresh gradients (one
process and DDP), and the user's gradients never change."""

import os
import tempfile

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn as nn

from hf_shampoo import DistributedShampoo, stages
from tests.helpers import TEST_DEVICE, assert_bitwise, join_gloo_world

MUON = dict(preconditioner="spectral_descent", betas=(0.95, 1.0), beta3=0.95**2,
            use_bias_correction=False, weight_decay=0.1,
            spectral_lr_adjustment="match_rms_adamw", newton_schulz_dtype=torch.bfloat16,
            max_preconditioner_dim=2**31 - 1, lr=0.02)
SHAMPOO = dict(grafting="adam", weight_decay=0.01, momentum=0.9, nesterov=True, lr=0.01,
               precondition_frequency=2, start_preconditioning_step=2,
               max_preconditioner_dim=256)


@pytest.mark.unit
@pytest.mark.parametrize("shapes", [[(300, 200)] * 3, [(7,)] * 40 + [(7,)], [(5, 3)] * 9])
def test_decay_from_views_equals_decay_from_a_stack(shapes):
    """``add_rows`` adds the parameters straight from their views, a large block alone and
    small ones in groups: the same bits as adding their stack."""
    gen = torch.Generator().manual_seed(0)
    rows = [torch.randn(s, generator=gen) for s in shapes]
    target = torch.randn((len(rows), *shapes[0]), generator=gen)
    expected = target.clone().add_(torch.stack(rows), alpha=0.1)
    stages.add_rows(target, rows, 0.1)
    assert torch.equal(target, expected)
    groups = list(stages.row_groups(rows))
    assert [i for a, b in groups for i in range(a, b)] == list(range(len(rows)))


def _model(seed=0, device="cpu"):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(96, 160, bias=False), nn.GELU(),
                         nn.Linear(160, 160, bias=False), nn.GELU(),
                         nn.Linear(160, 160, bias=False), nn.GELU(),
                         nn.Linear(160, 10, bias=False)).to(device)


def _train(config, set_to_none, steps=6, unused_at=3, device="cpu"):
    """Trains on fixed batches; at step ``unused_at`` the third layer gets no gradient (its
    stack's other block does)."""
    model = _model(device=device)
    opt = DistributedShampoo(model.parameters(), **config)
    gen = torch.Generator().manual_seed(1)
    for step in range(steps):
        x = torch.randn(32, 96, generator=gen).to(device)
        opt.zero_grad(set_to_none=set_to_none)
        if step == unused_at:
            model[4].weight.grad = None
            model[6](model[5](model[:4](x))).square().mean().backward()
        else:
            model(x).square().mean().backward()
        before = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
        opt.step()
        after = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
        assert all((a is None and b is None) or torch.equal(a, b)
                   for a, b in zip(before, after)), "the step changed a gradient"
    return model, opt


@pytest.mark.unit
@pytest.mark.device
@pytest.mark.parametrize("config", [MUON, SHAMPOO, dict(SHAMPOO, weight_decay_type="l2")],
                         ids=["muon", "shampoo", "shampoo_l2"])
def test_kept_gradients_train_as_fresh_ones(config):
    """``zero_grad(set_to_none=False)``: autograd accumulates into the views, the step
    stacks nothing, and every number equals a run whose gradients are fresh each step."""
    kept, opt = _train(config, set_to_none=False, device=TEST_DEVICE)
    fresh, _ = _train(config, set_to_none=True, device=TEST_DEVICE)
    assert_bitwise(list(kept.parameters()), list(fresh.parameters()))
    views = [p.grad._base is not None for p in kept.parameters()]
    # L2 decay writes into the stacked gradients: they stay the user's own tensors
    assert all(views) if config.get("weight_decay_type") != "l2" else not any(views)


@pytest.mark.unit
def test_views_are_made_only_where_the_layout_allows():
    conv = nn.Conv2d(3, 8, 3).to(memory_format=torch.channels_last)
    big = nn.Parameter(torch.randn(300, 40))  # cut into blocks of 128 rows
    half = nn.Parameter(torch.randn(40, 30, dtype=torch.bfloat16))
    plain = nn.Parameter(torch.randn(37, 30))
    shared = torch.zeros(41 * 30 + 5)  # someone else's buffer (a DDP bucket)
    params = [conv.weight, big, half, plain]
    opt = DistributedShampoo(params + [shared_param := nn.Parameter(torch.randn(41, 30))],
                             grafting="adam", max_preconditioner_dim=128, lr=0.01)
    for p in params:
        p.grad = torch.randn_like(p)
    shared_param.grad = shared[5:].view(41, 30)
    shared_param.grad.normal_()
    values = [p.grad.clone() for p in params + [shared_param]]
    opt.step()
    assert conv.weight.grad._base is None  # channels_last
    assert big.grad._base is None  # several blocks
    assert half.grad._base is None  # bfloat16 gradient, float32 stack
    assert shared_param.grad._base is shared  # stays the bucket's view
    assert_bitwise([p.grad for p in params + [shared_param]], values)
    # a gradient replaced after a view was made is read (and viewed) again
    assert plain.grad._base is not None
    plain.grad = torch.full_like(plain, 2.0)
    opt.step()
    assert plain.grad._base is not None and bool((plain.grad == 2.0).all())


@pytest.mark.unit
def test_fresh_gradients_stop_being_viewed_and_a_switch_to_l2_copies():
    """New gradient tensors every step (``zero_grad()``): after two such steps no view is
    made any more. Views kept, then L2 decay switched on: the step stacks a copy and the
    user's gradients stay as they were, with the numbers of fresh gradients."""
    fresh_model = _model()
    opt = DistributedShampoo(fresh_model.parameters(), **MUON)
    x = torch.randn(8, 96, generator=torch.Generator().manual_seed(2))
    for _ in range(4):
        opt.zero_grad()
        fresh_model(x).square().mean().backward()
        opt.step()
    assert not any(p.grad._base is not None for p in fresh_model.parameters())

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
            grads = [p.grad.clone() for p in model.parameters()]
            opt.step()
            assert_bitwise([p.grad for p in model.parameters()], grads)
        runs.append(list(model.parameters()))
    assert_bitwise(*runs)


def _ddp_worker(rank, world, init_file, out_dir):
    join_gloo_world(rank, world, init_file)
    model = _model()
    opt = DistributedShampoo(model.parameters(), distributed="ddp", **MUON)
    gen = torch.Generator().manual_seed(1)
    for _ in range(4):
        x = torch.randn(32, 96, generator=gen)  # the same batch on every rank
        opt.zero_grad(set_to_none=False)
        model(x).square().mean().backward()
        opt.step()
    torch.save([p.detach() for p in model.parameters()], os.path.join(out_dir, f"{rank}.pt"))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


@pytest.mark.distributed
def test_ddp_with_kept_gradients_equals_one_process():
    torch.set_num_threads(1)
    model = _model()
    opt = DistributedShampoo(model.parameters(), **MUON)
    gen = torch.Generator().manual_seed(1)
    for _ in range(4):
        x = torch.randn(32, 96, generator=gen)
        opt.zero_grad(set_to_none=False)
        model(x).square().mean().backward()
        opt.step()
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_ddp_worker, args=(2, os.path.join(out_dir, "init"), out_dir), nprocs=2)
        for rank in range(2):
            assert_bitwise(torch.load(os.path.join(out_dir, f"{rank}.pt")),
                           [p.detach() for p in model.parameters()])
