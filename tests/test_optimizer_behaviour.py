"""Behaviour around the step: skipped gradients, non-finite factors, convergence, param groups."""

import io
import math
import re

import pytest
import torch

from hf_shampoo import DistributedShampoo, ShampooNumericalError
from tests.helpers import F64, assert_resumes_exactly, generator, random_tensors, train_mse
from tests.reference_shampoo import ReferenceShampoo

pytestmark = [pytest.mark.unit, pytest.mark.device]

CONFIG = {
    "lr": 0.1,
    "betas": (0.9, 0.99),
    "epsilon": 1e-6,
    "max_preconditioner_dim": 4,
    "grafting": "adam",
    "momentum": 0.5,
    "precondition_frequency": 2,
    "start_preconditioning_step": 2,
}


def flat_state(opt):
    """state_dict()['state'] as {path: value}, whatever its nesting (layout is the package's)."""
    buffer = io.BytesIO()
    torch.save(opt.state_dict()["state"], buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    out = {}

    def walk(prefix, obj):
        if isinstance(obj, dict):
            for k, v in obj.items():
                walk(prefix + (str(k),), v)
        elif isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                walk(prefix + (i,), v)
        else:
            out[prefix] = obj

    walk((), state)
    return out


def same(a, b):
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
    return type(a) is type(b) and a == b


def close(a, b):
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and torch.allclose(a, b, rtol=1e-12, atol=0)
    return same(a, b)


@pytest.mark.parametrize("preconditioner", ["shampoo", "eigenvalue_corrected"])
def test_param_without_grad_is_skipped(preconditioner):
    """docs/design.md §2: a block whose gradient is None is skipped entirely (no state update,
    no move); the group's step counter t still advances (it counts step() calls)."""
    config = {**CONFIG, "preconditioner": preconditioner}
    shapes = [(5, 3), (4, 6)]
    inits = [random_tensors(s, 1, seed=50 + i)[0] for i, s in enumerate(shapes)]
    grads = [random_tensors(s, 6, seed=60 + i) for i, s in enumerate(shapes)]
    skip_at = {3, 4}  # steps (1-based) at which the second param has no gradient (4: a refresh)

    def run(skip):
        ps = [torch.nn.Parameter(w.clone()) for w in inits]
        opt = DistributedShampoo(ps, factor_matrix_dtype=F64, **config)
        snapshots = []
        for t in range(1, 7):
            ps[0].grad = grads[0][t - 1].clone()
            ps[1].grad = None if (skip and t in skip_at) else grads[1][t - 1].clone()
            before = [p.detach().clone() for p in ps]
            state_before = flat_state(opt)
            opt.step()
            snapshots.append(
                (before, state_before, [p.detach().clone() for p in ps], flat_state(opt))
            )
        return ps, snapshots

    ps, snaps = run(skip=True)
    _, snaps_full = run(skip=False)
    for t in sorted(skip_at):
        before, state_before, after, state_after = snaps[t - 1]
        assert torch.equal(after[1], before[1]), f"step {t}: skipped param moved"
        assert not torch.equal(after[0], before[0]), f"step {t}: other param did not move"
        # compare with the same step where the second param did get its gradient (same state
        # before the step only at the first skipped step)
        if t == min(skip_at):
            full_after = snaps_full[t - 1][3]
            assert state_after.keys() == state_before.keys() == full_after.keys()
            kept = 0
            for key in state_after:
                # every entry either did not change, or changed exactly as when the second
                # param also had a gradient (i.e. it belongs to the first param / the counter)
                assert same(state_after[key], state_before[key]) or close(
                    state_after[key], full_after[key]
                ), f"state entry {key} changed although its parameter had no gradient"
                if not same(full_after[key], state_before[key]) and same(
                    state_after[key], state_before[key]
                ):
                    kept += 1
            assert kept > 0, "no state entry of the skipped parameter was found unchanged"

    # afterwards both params follow the reference in which t counts every step() call
    for i in range(2):
        ref = ReferenceShampoo(inits[i], **config)
        for t in range(1, 7):
            ref.step(None if (i == 1 and t in skip_at) else grads[i][t - 1])
        torch.testing.assert_close(ps[i].detach(), ref.param, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("preconditioner", ["shampoo", "eigenvalue_corrected"])
def test_non_finite_factor_at_refresh_raises_and_changes_nothing(preconditioner):
    """With the gradient check off, a NaN gradient reaches the factor statistics; the
    refresh finds the non-finite factor before anything changes."""
    gen = generator(0)
    named = [
        ("encoder.w_first", torch.nn.Parameter(torch.randn(4, 3, generator=gen))),
        ("decoder.w_second", torch.nn.Parameter(torch.randn(5, generator=gen))),
    ]
    opt = DistributedShampoo(named, lr=0.1, precondition_frequency=3, preconditioner=preconditioner,
                             check_finite_gradients=False)
    for _ in range(5):  # refreshes at t = 3 (and 6)
        for _, p in named:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    named[0][1].grad = torch.randn(4, 3, generator=gen)
    bad = torch.randn(5, generator=gen)
    bad[2] = float("nan")
    named[1][1].grad = bad
    before = [p.detach().clone() for _, p in named]
    with pytest.raises(RuntimeError) as info:
        opt.step()  # t = 6: refresh with a NaN factor
    message = str(info.value)
    assert "decoder.w_second" in message
    assert re.search(r"(?<![\d.])6(?![\d.])", message), message
    for (name, p), b in zip(named, before):
        assert torch.equal(p.detach(), b), f"{name} changed by the failing step"


@pytest.mark.parametrize(
    "config",
    [
        pytest.param({"lr": 0.1}, id="defaults-but-lr"),
        pytest.param(
            {
                "lr": 0.05,
                "grafting": "adam",
                "betas": (0.9, 0.999),
                "precondition_frequency": 5,
                "epsilon": 1e-8,
            },
            id="shampoo-adam-grafting",
        ),
        pytest.param(
            {
                "lr": 0.05,
                "preconditioner": "eigenvalue_corrected",
                "betas": (0.9, 0.95),
                "epsilon": 1e-8,
                "precondition_frequency": 5,
            },
            id="eigenvalue-corrected",
        ),
        pytest.param(
            {
                "lr": 0.05,
                "preconditioner": "eigenvalue_corrected",
                "eigendecomposition": "qr",
                "betas": (0.9, 0.95),
                "epsilon": 1e-8,
                "precondition_frequency": 2,
            },
            id="eigenvalue-corrected-qr",
        ),
    ],
)
def test_tiny_regression_loss_decreases(config):
    gen = generator(0)
    x = torch.randn(64, 6, generator=gen)
    w_true = torch.randn(6, 3, generator=gen)
    y = x @ w_true + 0.01 * torch.randn(64, 3, generator=gen)
    model = torch.nn.Linear(6, 3)
    torch.nn.init.zeros_(model.weight)
    torch.nn.init.zeros_(model.bias)
    opt = DistributedShampoo(model.named_parameters(), max_preconditioner_dim=8, **config)

    def loss_fn():
        return torch.nn.functional.mse_loss(model(x), y)

    initial = loss_fn().item()
    for _ in range(40):
        opt.zero_grad()
        loss = loss_fn()
        loss.backward()
        opt.step()
    final = loss_fn().item()
    assert final < 0.5 * initial, (initial, final)


def test_step_with_closure_returns_loss():
    p = torch.nn.Parameter(torch.ones(3, 2))
    opt = DistributedShampoo([p], lr=0.1)

    def closure():
        opt.zero_grad()
        loss = (p**2).sum()
        loss.backward()
        return loss

    loss = opt.step(closure)
    assert loss.item() == pytest.approx(6.0)
    assert not torch.equal(p.detach(), torch.ones(3, 2))


def test_param_groups_with_their_own_hyperparameters():
    shapes = [(4, 5), (6,), (5, 4)]
    group_configs = [
        {"lr": 0.1, "grafting": "adam", "momentum": 0.5, "precondition_frequency": 2},
        {"lr": 0.03, "grafting": "sgd", "betas": (0.5, 0.99), "weight_decay": 0.1},
        {
            "lr": 0.05,
            "preconditioner": "eigenvalue_corrected",
            "max_preconditioner_dim": 3,
            "betas": (0.9, 0.99),
            "start_preconditioning_step": 3,
        },
    ]
    defaults = {"epsilon": 1e-6, "max_preconditioner_dim": 4}
    inits = [random_tensors(s, 1, seed=70 + i)[0] for i, s in enumerate(shapes)]
    grads = [random_tensors(s, 5, seed=80 + i) for i, s in enumerate(shapes)]
    ps = [torch.nn.Parameter(w.clone()) for w in inits]
    opt = DistributedShampoo(
        [{"params": [p], **cfg} for p, cfg in zip(ps, group_configs)],
        factor_matrix_dtype=F64,
        **defaults,
    )
    refs = [ReferenceShampoo(w, **{**defaults, **cfg}) for w, cfg in zip(inits, group_configs)]
    for t in range(5):
        for i in range(len(shapes)):
            ps[i].grad = grads[i][t].clone()
            refs[i].step(grads[i][t])
        opt.step()
        for i in range(len(shapes)):
            torch.testing.assert_close(
                ps[i].detach(),
                refs[i].param,
                # round-off only: cuBLAS's float64 products against the reference's differ
                # by 2.4e-9 (relative) after 5 steps on an H200; a wrong formula is O(1)
                rtol=1e-8,
                atol=1e-11,
                msg=lambda m, t=t, i=i: f"group {i}, step {t + 1}: {m}",
            )


def test_step_counter_is_per_group():
    """A group whose params never have a gradient still counts its steps (t per group), so a
    param added later in its own group starts at t = 1."""
    config = {"lr": 0.1, "betas": (0.9, 0.99), "max_preconditioner_dim": 4, "epsilon": 1e-6}
    (w_a,), (w_b,) = random_tensors((4, 5), 1, seed=90), random_tensors((4, 5), 1, seed=91)
    grads = random_tensors((4, 5), 6, seed=92)
    pa, pb = torch.nn.Parameter(w_a.clone()), torch.nn.Parameter(w_b.clone())
    opt = DistributedShampoo([pa], factor_matrix_dtype=F64, **config)
    for t in range(3):
        pa.grad = grads[t].clone()
        opt.step()
    opt.add_param_group({"params": [pb]})
    ref = ReferenceShampoo(w_b, **config)
    for t in range(3, 6):
        pa.grad = grads[t].clone()
        pb.grad = grads[t].clone()
        opt.step()
        ref.step(grads[t])
    torch.testing.assert_close(pb.detach(), ref.param, rtol=1e-9, atol=1e-12)


def test_diagonal_preconditioner_is_the_grafting_method_alone():
    """preconditioner="diagonal" with Adam grafting is Adam, at every step (also after the
    steps where Shampoo would start preconditioning), and keeps no factor matrices."""
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(5, 3, dtype=torch.float64))
    w_ref = torch.nn.Parameter(w.detach().clone())
    opt = DistributedShampoo([w], lr=0.01, betas=(0.9, 0.99), grafting="adam",
                             grafting_beta2=0.99, grafting_epsilon=1e-8,
                             preconditioner="diagonal", precondition_frequency=2)
    ref = torch.optim.Adam([w_ref], lr=0.01, betas=(0.9, 0.99), eps=1e-8)
    for _ in range(6):
        g = torch.randn(5, 3, dtype=torch.float64)
        w.grad, w_ref.grad = g.clone(), g.clone()
        opt.step()
        ref.step()
    torch.testing.assert_close(w, w_ref, rtol=1e-12, atol=1e-14)
    keys = opt.state_dict()["state"][0]
    assert not any("factor_matrix" in k for k in keys)


def _state_snapshot(opt) -> dict:
    return {(i, k): v.clone() for i, entry in opt.state_dict()["state"].items()
            for k, v in entry.items()}


@pytest.mark.parametrize("bad_value", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("preconditioner", ["shampoo", "eigenvalue_corrected", "diagonal",
                                            "spectral_descent"])
def test_non_finite_gradient_between_refreshes_is_refused(bad_value, preconditioner):
    """A nan or inf gradient on a step without a refresh raises at that step, naming the
    parameter, with no parameter, state or step counter changed; the run then continues
    exactly as one that never saw the bad gradient."""
    gen = generator(1)
    shapes = {"encoder.w": (6, 4), "decoder.w": (5, 3)}
    init = {n: torch.randn(s, generator=gen) for n, s in shapes.items()}
    grads = [{n: torch.randn(s, generator=gen) for n, s in shapes.items()} for _ in range(6)]
    config = dict(lr=0.05, precondition_frequency=5, preconditioner=preconditioner,
                  grafting="adam" if preconditioner != "spectral_descent" else None)

    def run(poison_at: int | None):
        named = [(n, torch.nn.Parameter(v.clone())) for n, v in init.items()]
        opt = DistributedShampoo(named, **config)
        for t, g in enumerate(grads, start=1):
            if t == poison_at:
                for n, p in named:
                    p.grad = g[n].clone()
                named[1][1].grad[2, 1] = bad_value
                params, state = [p.detach().clone() for _, p in named], _state_snapshot(opt)
                with pytest.raises(ShampooNumericalError) as info:
                    opt.step()
                message = str(info.value)
                assert "'decoder.w'" in message and "'encoder.w'" not in message, message
                assert f"step {t}" in message and "check_finite_gradients" in message
                assert all(torch.equal(p.detach(), b) for (_, p), b in zip(named, params))
                after = _state_snapshot(opt)
                assert after.keys() == state.keys()
                assert all(torch.equal(after[k], state[k]) for k in state)
                assert opt.param_groups[0]["step"] == t - 1
            for n, p in named:
                p.grad = g[n].clone()
            opt.step()
        return [p.detach() for _, p in named]

    clean, poisoned = run(None), run(3)  # step 3: no refresh (they are at 5, 10, ...)
    for a, b in zip(clean, poisoned):
        assert torch.equal(a, b)


def test_the_gradient_check_can_be_turned_off():
    """check_finite_gradients=False: the step does not look (the caller checks elsewhere);
    a nan gradient between refreshes then reaches the weights, as the docs say."""
    p = torch.nn.Parameter(torch.ones(4, 3))
    opt = DistributedShampoo([p], lr=0.1, precondition_frequency=10,
                             check_finite_gradients=False)
    p.grad = torch.ones(4, 3)
    opt.step()
    p.grad = torch.full((4, 3), float("nan"))
    opt.step()
    assert torch.isnan(p.detach()).all()


@pytest.mark.parametrize("value", [0, 1, "yes", None])
def test_check_finite_gradients_must_be_a_bool(value):
    with pytest.raises(ValueError, match="check_finite_gradients.*expected True or False"):
        DistributedShampoo([torch.nn.Parameter(torch.ones(2))], check_finite_gradients=value)


def test_check_finite_gradients_is_one_setting_for_the_whole_optimizer():
    a, b = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(3))
    with pytest.raises(ValueError, match="check_finite_gradients=False differs"):
        DistributedShampoo([{"params": [a]}, {"params": [b], "check_finite_gradients": False}])


def _partly_frozen_model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 32), torch.nn.Tanh(), torch.nn.Linear(32, 3))
    model[0].requires_grad_(False)  # frozen: weight and bias
    return model


_train = train_mse


def test_frozen_parameters_hold_no_state_and_describe_says_so():
    from hf_shampoo.describe_table import describe, describe_rows

    model = _partly_frozen_model()
    opt = DistributedShampoo(model.named_parameters(), lr=0.01, grafting="adam",
                             precondition_frequency=2)
    frozen = [p.detach().clone() for p in model[0].parameters()]
    _train(model, opt, 3)
    assert sorted(opt.state_dict()["state"]) == [2, 3]  # model[2].weight and bias only
    assert {b["param_index"] for b in opt.describe_blocks()} == {2, 3}
    assert all(torch.equal(p.detach(), f) for p, f in zip(model[0].parameters(), frozen))
    rows = describe_rows(opt)
    assert [r["frozen"] for r in rows] == [True, True, False, False]
    assert rows[0]["name"] == "0.weight" and rows[0]["blocks"] == "frozen: no state"
    assert "4 parameters (2 frozen, without state)" in describe(opt)
    # the same state as an optimizer given only the trainable parameters
    only = _partly_frozen_model()
    opt_only = DistributedShampoo(only[2].parameters(), lr=0.01, grafting="adam",
                                  precondition_frequency=2)
    _train(only, opt_only, 3)
    assert all(torch.equal(a.detach(), b.detach())
               for a, b in zip(only[2].parameters(), model[2].parameters()))
    mine = opt.state_dict()["state"]
    theirs = opt_only.state_dict()["state"]
    assert mine[2].keys() == theirs[0].keys()
    assert all(torch.equal(mine[2][k], theirs[0][k]) for k in mine[2])


def test_a_partly_frozen_model_resumes_exactly():
    assert_resumes_exactly(
        _partly_frozen_model,
        lambda model: DistributedShampoo(model.parameters(), lr=0.01, grafting="adam",
                                         precondition_frequency=2),
        lambda model, opt, steps, seed: _train(model, opt, steps, seed=seed))


def test_state_saved_for_a_parameter_that_is_frozen_now_is_kept():
    """As in torch: a checkpoint's state for a parameter loads even if it is frozen now,
    and comes back in ``state_dict()``."""
    model = _partly_frozen_model()
    model[0].requires_grad_(True)
    opt = DistributedShampoo(model.parameters(), lr=0.01, precondition_frequency=2)
    _train(model, opt, 2)
    saved = opt.state_dict()
    again = _partly_frozen_model()
    opt2 = DistributedShampoo(again.parameters(), lr=0.01, precondition_frequency=2)
    opt2.load_state_dict(saved)
    loaded = opt2.state_dict()["state"]
    assert sorted(loaded) == [0, 1, 2, 3]
    assert all(torch.equal(loaded[0][k], saved["state"][0][k]) for k in saved["state"][0])


def test_describe_blocks_places_every_block_in_its_parameter():
    """``merged_shape`` and ``offset`` of ``describe_blocks()`` rows tile each parameter:
    every element is in exactly one block, of the row's shape (what a reader needs to take
    a block's gradient slice without private attributes)."""
    params = [torch.nn.Parameter(torch.randn(10, 6)), torch.nn.Parameter(torch.randn(3, 4, 5)),
              torch.nn.Parameter(torch.randn(7))]
    opt = DistributedShampoo(params, max_preconditioner_dim=4)
    rows = opt.describe_blocks()
    for index, param in enumerate(params):
        mine = [row for row in rows if row["param_index"] == index]
        merged = mine[0]["merged_shape"]
        assert all(row["merged_shape"] == merged for row in mine)
        assert math.prod(merged) == param.numel()
        covered = torch.zeros(merged, dtype=torch.int64)
        for row in mine:
            window = tuple(slice(o, o + n) for o, n in zip(row["offset"], row["shape"]))
            assert covered[window].shape == tuple(row["shape"])
            covered[window] += 1
        assert bool((covered == 1).all()), index
    assert len({row["param_index"] for row in rows if len(row["shape"]) > 0}) == 3


def _moved_by_one_ulp(steps: int = 5, **config) -> float:
    """A (17,) vector (one 17 × 17 factor: rank-deficient for its first 17 steps) trained
    ``steps`` steps twice, the second time with its first gradient one ulp higher: the
    relative distance of the two moves (docs/hyperparameters.md, epsilon)."""
    moves = []
    for nudge in (False, True):
        param = torch.nn.Parameter(torch.randn(17, generator=generator(0)))
        start = param.detach().clone()
        opt = DistributedShampoo([param], **{
            "lr": 1e-2, "grafting": "adam", "precondition_frequency": 1,
            "start_preconditioning_step": 1, **config})
        gen = generator(1)
        for step in range(steps):
            grad = torch.randn(17, generator=gen)
            if nudge and step == 0:
                grad = torch.nextafter(grad, torch.full_like(grad, math.inf))
            param.grad = grad
            opt.step()
        moves.append(param.detach() - start)
    return float((moves[1] - moves[0]).norm() / moves[0].norm())


def test_a_tiny_epsilon_amplifies_rounding_in_rank_deficient_factors():
    """The numbers docs/hyperparameters.md gives for ``epsilon``: with factors still
    rank-deficient, a 1-ulp change of one gradient moves the run by percents at
    epsilon=1e-10 (2.0e-2 measured on the CPU; 0.18 at the default 1e-12) and by 8e-5 at
    1e-4; the pseudo-inverse, or preconditioning that starts once the factor is full rank,
    keep it at rounding level."""
    assert _moved_by_one_ulp(epsilon=1e-12) > 5e-2
    assert _moved_by_one_ulp(epsilon=1e-10) > 5e-3
    assert _moved_by_one_ulp(epsilon=1e-6) < 1e-3
    assert _moved_by_one_ulp(epsilon=1e-4) < 2e-4
    assert _moved_by_one_ulp(rank_deficient="pseudo_inverse", epsilon=0.0,
                             rank_rtol=None) < 1e-5
    late = dict(epsilon=1e-12, start_preconditioning_step=18, steps=23)
    assert _moved_by_one_ulp(**late) < 1e-5
    assert _moved_by_one_ulp(**{**late, "start_preconditioning_step": 1}) > 5e-2
