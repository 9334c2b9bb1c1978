"""Iterate averaging (``iterate_averaging="gpa" | "schedule_free"``, hf_shampoo/averaging.py).

Against torch: GPA with ``train_interp_coeff=1`` is SGD with heavy-ball momentum, and with
``eval = train = β`` SGD with Nesterov momentum (lr scaled by 1/(1-β), as Meta documents).
Against a dense float64 formula: schedule-free's three sequences with an lr schedule and
decoupled weight decay, the averaged weights after ``eval()``. Then: every kind runs, the
``eval()`` / ``train()`` round trip, ``step()`` refused in eval mode before anything
changes, exact resume from a checkpoint saved in either mode, validation, the Trainer.
(Meta's numbers: benchmarks/parity.py; DDP / FSDP2: tests/test_distributed.py and
tests/test_sharded.py scenarios ``gpa_decoupled`` and ``schedule_free_soap``.)
"""

from __future__ import annotations

import copy

import pytest
import torch

from hf_shampoo import DistributedShampoo
from tests.helpers import F64, random_tensors

pytestmark = pytest.mark.unit

OFF = {"precondition_frequency": 100, "start_preconditioning_step": 100}  # no Shampoo yet
SHAPES = [(4, 3), (5,)]


def _params(dtype=F64):
    return [torch.nn.Parameter(random_tensors(s, 1, seed=10 + i)[0].to(dtype))
            for i, s in enumerate(SHAPES)]


def _quadratic_grads(params):
    """Gradients of ``Σ ½‖A w - b‖²``-like losses, so that where they are taken matters."""
    for i, p in enumerate(params):
        target = torch.linspace(-1, 1, p.numel(), dtype=p.dtype).view(p.shape)
        p.grad = (p.detach() - target) * (1.5 + i) + 0.1 * torch.sin(p.detach())


@pytest.mark.parametrize(("beta", "nesterov"), [(0.5, False), (0.75, False), (0.5, True)])
def test_gpa_is_sgd_momentum(beta, nesterov):
    lr = 0.125
    ours_p, torch_p = _params(), _params()
    ours = DistributedShampoo(ours_p, lr=lr / (1 - beta), betas=(0.0, 1.0), **OFF,
                              factor_matrix_dtype=F64, iterate_averaging="gpa",
                              eval_interp_coeff=beta,
                              train_interp_coeff=beta if nesterov else 1.0)
    theirs = torch.optim.SGD(torch_p, lr=lr, momentum=beta, nesterov=nesterov)
    for _ in range(8):
        _quadratic_grads(ours_p)
        _quadratic_grads(torch_p)
        ours.step()
        theirs.step()
        # heavy ball: the gradient point y is x; Nesterov: torch's iterate is y
        for a, b in zip(ours_p, torch_p):
            torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-12, atol=1e-12)


def _schedule_free_reference(params, lrs, mu_y, power, weight_decay):
    """Schedule-free in its y/z form with Meta's weights μ_x = 1 - lr_t^p / Σ lr_i^p and
    decoupled decay shrinking z, float64: z' = (1 - lr α) z + u,
    y' = μ_x y + (1 - μ_x) z_decayed + (1 - μ_x μ_y) u with u = -lr ∇f(y); the averaged
    weights x = y + (1 - 1/μ_y)(z - y) (without decay: x' = μ_x x + (1 - μ_x) z')."""
    z = [p.detach().clone() for p in params]
    y = [p.detach().clone() for p in params]
    total = 0.0
    for lr in lrs:
        probe = [torch.nn.Parameter(t.clone()) for t in y]
        _quadratic_grads(probe)
        total += lr**power
        mu_x = 1 - lr**power / total
        u = [-lr * p.grad for p in probe]
        z = [(1 - lr * weight_decay) * zi for zi in z]
        y = [mu_x * yi + (1 - mu_x) * zi + (1 - mu_x * mu_y) * ui
             for yi, zi, ui in zip(y, z, u)]
        z = [zi + ui for zi, ui in zip(z, u)]
    x = [yi + (1 - 1 / mu_y) * (zi - yi) for yi, zi in zip(y, z)]
    return x, y


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_schedule_free_follows_the_dense_formula(weight_decay):
    lrs = [0.02 * min(t + 1, 3) / 3 for t in range(10)]  # a warm-up, then constant
    params = _params()
    x_ref, y_ref = _schedule_free_reference(params, lrs, 0.8, 2, weight_decay)
    opt = DistributedShampoo(params, lr=lrs[0], betas=(0.0, 1.0), **OFF,
                             factor_matrix_dtype=F64, iterate_averaging="schedule_free",
                             weight_decay=weight_decay)
    for lr in lrs:
        opt.param_groups[0]["lr"] = lr
        _quadratic_grads(params)
        opt.step()
    # the coefficients are Meta's float32 values: agreement to their rounding
    for p, want in zip(params, y_ref):
        torch.testing.assert_close(p.detach(), want, rtol=1e-6, atol=1e-8)
    opt.eval()
    for p, want in zip(params, x_ref):
        torch.testing.assert_close(p.detach(), want, rtol=1e-6, atol=1e-8)
    opt.train()
    for p, want in zip(params, y_ref):
        torch.testing.assert_close(p.detach(), want, rtol=1e-6, atol=1e-8)


def test_schedule_free_warm_up_from_lr_zero_stays_finite():
    params = _params()
    opt = DistributedShampoo(params, lr=0.0, iterate_averaging="schedule_free", grafting="adam",
                             factor_matrix_dtype=F64)
    before = [p.detach().clone() for p in params]
    _quadratic_grads(params)
    opt.step()  # Meta's 1 - 0/0 would be nan
    assert all(torch.equal(p.detach(), b) for p, b in zip(params, before))
    opt.param_groups[0]["lr"] = 0.01
    _quadratic_grads(params)
    opt.step()
    opt.eval()
    assert all(torch.isfinite(p).all() for p in params)


KINDS = [
    dict(grafting="adam"),
    dict(preconditioner="eigenvalue_corrected", epsilon=1e-8),
    dict(preconditioner="kl_shampoo", grafting="adam"),
    dict(preconditioner="diagonal", grafting="adam"),
    dict(preconditioner="eigendecomposed_shampoo", grafting="adam"),
    dict(preconditioner="sign_descent"),
    dict(grafting="adam", quantization="4bit", statistics_frequency=1),
]


@pytest.mark.parametrize("mode", ["gpa", "schedule_free"])
@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.get("preconditioner", "shampoo")
                         + ("_4bit" if "quantization" in k else ""))
def test_every_kind_averages_and_switches(kind, mode):
    params = [torch.nn.Parameter(t) for t in random_tensors((6, 5), 2, seed=3)]
    opt = DistributedShampoo(params, lr=0.01, precondition_frequency=2, iterate_averaging=mode,
                             weight_decay=0.01, **kind)
    for _ in range(5):
        _quadratic_grads(params)
        opt.step()
    state = opt.state_dict()["state"]
    assert all(any(k.endswith("iterate_offset") for k in entry) for entry in state.values())
    y = [p.detach().clone() for p in params]
    opt.eval()
    x = [p.detach().clone() for p in params]
    assert all(not torch.equal(a, b) for a, b in zip(x, y))
    opt.eval()  # already there: nothing moves
    assert all(torch.equal(p.detach(), b) for p, b in zip(params, x))
    opt.train()
    for p, b in zip(params, y):
        torch.testing.assert_close(p.detach(), b, rtol=1e-6, atol=1e-7)


def test_step_in_eval_mode_is_refused_before_anything_changes():
    params = _params(torch.float32)
    opt = DistributedShampoo(params, lr=0.01, grafting="adam", iterate_averaging="gpa")
    _quadratic_grads(params)
    opt.step()
    opt.eval()
    saved = copy.deepcopy(opt.state_dict())
    before = [p.detach().clone() for p in params]
    called = []
    _quadratic_grads(params)
    with pytest.raises(RuntimeError, match=r"eval mode.*optimizer\.train\(\)"):
        opt.step(closure=lambda: called.append(1))
    assert not called  # the closure did not run either
    assert all(torch.equal(p.detach(), b) for p, b in zip(params, before))
    after = opt.state_dict()
    assert after["param_groups"] == saved["param_groups"]
    for index, entry in saved["state"].items():
        assert all(torch.equal(after["state"][index][k], t) for k, t in entry.items())


def test_switching_before_the_first_step_moves_nothing():
    params = _params()
    before = [p.detach().clone() for p in params]
    opt = DistributedShampoo(params, iterate_averaging="schedule_free")
    opt.eval()
    assert opt.param_groups[0]["train_mode"] is False
    opt.train()
    assert all(torch.equal(p.detach(), b) for p, b in zip(params, before))


def test_groups_without_averaging_are_left_alone():
    a, b = _params()
    opt = DistributedShampoo([{"params": [a], "iterate_averaging": "gpa"}, {"params": [b]}],
                             lr=0.01, grafting="adam")
    _quadratic_grads([a, b])
    opt.step()
    b_before = b.detach().clone()
    opt.eval()
    assert torch.equal(b.detach(), b_before)
    assert "train_mode" not in opt.param_groups[1]


@pytest.mark.parametrize("save_in", ["train", "eval"])
@pytest.mark.parametrize("mode", ["gpa", "schedule_free"])
def test_resume_from_a_checkpoint_is_exact(mode, save_in):
    def make(params):
        return DistributedShampoo(params, lr=0.01, grafting="adam", precondition_frequency=2,
                                  iterate_averaging=mode, weight_decay=0.05)

    def run(opt, params, steps):
        for _ in range(steps):
            opt.train()
            _quadratic_grads(params)
            opt.step()

    params = _params(torch.float32)
    opt = make(params)
    run(opt, params, 4)
    if save_in == "eval":
        opt.eval()
    saved_params = [p.detach().clone() for p in params]
    saved = copy.deepcopy(opt.state_dict())
    run(opt, params, 3)
    opt.eval()

    resumed = [torch.nn.Parameter(t.clone()) for t in saved_params]
    opt2 = make(resumed)
    opt2.load_state_dict(saved)
    assert opt2.param_groups[0]["train_mode"] == (save_in == "train")
    run(opt2, resumed, 3)
    opt2.eval()
    for a, b in zip(params, resumed):
        assert torch.equal(a.detach(), b.detach())


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(iterate_averaging="ema"), r"iterate_averaging='ema'.*None, 'gpa', 'schedule_free'"),
    (dict(iterate_averaging="gpa", eval_interp_coeff=1.0), r"eval_interp_coeff=1\.0.*\[0\.0, 1"),
    (dict(iterate_averaging="gpa", train_interp_coeff=0.0), r"train_interp_coeff=0\.0"),
    (dict(iterate_averaging="schedule_free", eval_coeff_lr_power=-1), "eval_coeff_lr_power"),
    (dict(iterate_averaging="gpa", momentum=0.9), r"momentum=0\.9.*expected 0\.0 with it"),
])
def test_invalid_settings_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DistributedShampoo(_params(), **kwargs)


def test_a_checkpoint_with_averaging_is_refused_by_an_optimizer_without():
    params = _params()
    opt = DistributedShampoo(params, iterate_averaging="gpa", grafting="adam")
    _quadratic_grads(params)
    opt.step()
    other = DistributedShampoo(_params(), grafting="adam")
    with pytest.raises(ValueError, match="iterate_averaging='gpa'"):
        other.load_state_dict(opt.state_dict())


def test_trainer_trains_at_y_evaluates_and_ends_at_the_averaged_weights(tmp_path):
    pytest.importorskip("transformers")
    from transformers import Trainer

    from tests.tiny_trainer import dataset, tiny_gpt2, training_args

    model = tiny_gpt2()
    args = training_args(tmp_path, optim="distributed_shampoo", learning_rate=1e-3,
                         optim_args="iterate_averaging=schedule_free,precondition_frequency=2",
                         lr_scheduler_type="constant", eval_strategy="steps", eval_steps=2,
                         max_steps=4)
    seen = []
    trainer = Trainer(model=model, args=args, train_dataset=dataset(), eval_dataset=dataset(4))
    optimizer = trainer.create_optimizer()
    assert optimizer.param_groups[0]["iterate_averaging"] == "schedule_free"
    model.register_forward_pre_hook(
        lambda module, inputs: seen.append((module.training,
                                            optimizer.param_groups[0]["train_mode"])))
    trainer.train()
    assert {mode for training, mode in seen if training} == {True}
    assert {mode for training, mode in seen if not training} == {False}
    assert optimizer.param_groups[0]["train_mode"] is False  # ended at the averaged weights
    x = [p.detach().clone() for p in model.parameters()]
    trainer.save_model(str(tmp_path / "final"))
    optimizer.train()
    y = [p.detach().clone() for p in model.parameters()]
    assert any(not torch.equal(a, b) for a, b in zip(x, y))
    from transformers import GPT2LMHeadModel

    saved = GPT2LMHeadModel.from_pretrained(str(tmp_path / "final"))
    for a, b in zip(saved.parameters(), x):
        assert torch.equal(a.detach(), b)


def test_accelerate_wrapper_forwards_train_and_eval():
    pytest.importorskip("accelerate")
    from accelerate import Accelerator

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = DistributedShampoo(model.parameters(), lr=0.01, grafting="adam",
                             iterate_averaging="gpa")
    model, wrapped = Accelerator(cpu=True).prepare(model, opt)
    model(torch.randn(8, 4)).square().mean().backward()
    wrapped.step()
    y = [p.detach().clone() for p in model.parameters()]
    wrapped.eval()
    assert opt.param_groups[0]["train_mode"] is False
    assert any(not torch.equal(p.detach(), b) for p, b in zip(model.parameters(), y))
    wrapped.train()
    assert opt.param_groups[0]["train_mode"] is True


def test_trainer_with_load_best_model_at_end_keeps_the_best_averaged_weights(tmp_path):
    pytest.importorskip("transformers")
    from transformers import GPT2LMHeadModel, Trainer

    from tests.tiny_trainer import dataset, tiny_gpt2, training_args

    model = tiny_gpt2()
    args = training_args(tmp_path, optim="distributed_shampoo", learning_rate=1e-3,
                         optim_args="iterate_averaging=gpa", eval_strategy="steps",
                         eval_steps=2, save_strategy="steps", save_steps=2, max_steps=5,
                         load_best_model_at_end=True, metric_for_best_model="loss")
    trainer = Trainer(model=model, args=args, train_dataset=dataset(), eval_dataset=dataset(4))
    trainer.train()
    optimizer = trainer.optimizer.optimizer if hasattr(trainer.optimizer, "optimizer") \
        else trainer.optimizer
    assert optimizer.param_groups[0]["train_mode"] is False
    # the loaded best checkpoint was saved right after its evaluation (averaged weights)
    # and is left as loaded, not moved again
    best = GPT2LMHeadModel.from_pretrained(trainer.state.best_model_checkpoint)
    for a, b in zip(best.parameters(), model.parameters()):
        assert torch.equal(a.detach(), b.detach())
