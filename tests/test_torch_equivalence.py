"""With preconditioning switched off, the optimizer is a classic torch optimizer
(docs/design.md §2).

start_preconditioning_step = precondition_frequency = 100 > steps run, so no amortized
computation happens; before it, steps 3-8 reduce to the grafting method (or to Ĝ itself).
"""

import pytest
import torch

from hf_shampoo import DistributedShampoo
from tests.helpers import F64, random_tensors

pytestmark = [pytest.mark.reference, pytest.mark.device]

OFF = {"precondition_frequency": 100, "start_preconditioning_step": 100}
SHAPES = [(4, 3), (5,)]
STEPS = 6


def compare(shampoo_kwargs, torch_factory, lrs=None):
    params_a = [
        torch.nn.Parameter(w)
        for w in (random_tensors(s, 1, seed=10 + i)[0] for i, s in enumerate(SHAPES))
    ]
    params_b = [torch.nn.Parameter(p.detach().clone()) for p in params_a]
    grads = [random_tensors(s, STEPS, seed=20 + i) for i, s in enumerate(SHAPES)]
    ours = DistributedShampoo(params_a, factor_matrix_dtype=F64, **OFF, **shampoo_kwargs)
    theirs = torch_factory(params_b)
    for t in range(STEPS):
        if lrs is not None:
            ours.param_groups[0]["lr"] = lrs[t]
            theirs.param_groups[0]["lr"] = lrs[t]
        for i in range(len(SHAPES)):
            params_a[i].grad = grads[i][t].clone()
            params_b[i].grad = grads[i][t].clone()
        ours.step()
        theirs.step()
        for a, b in zip(params_a, params_b):
            torch.testing.assert_close(
                a.detach(),
                b.detach(),
                rtol=1e-9,
                atol=1e-12,
                msg=lambda m, t=t: f"after step {t + 1}: {m}",
            )


def grafted(method, lr, **keywords):
    """The keywords of a run whose direction is the grafting ``method``'s alone: no
    momentum of Shampoo's own (``betas=(0, 1)``)."""
    return {"lr": lr, "betas": (0.0, 1.0), "grafting": method, **keywords}


@pytest.mark.parametrize("grafting", [None, "sgd"])
@pytest.mark.parametrize(
    ("momentum", "nesterov", "weight_decay"),
    [(0.0, False, 0.0), (0.9, False, 0.0), (0.9, True, 0.0), (0.8, False, 0.1), (0.7, True, 0.2)],
)
def test_sgd(grafting, momentum, nesterov, weight_decay):
    compare(
        grafted(grafting, 0.1, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay,
                weight_decay_type="l2"),
        lambda ps: torch.optim.SGD(
            ps, lr=0.1, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay
        ),
    )


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_adagrad(weight_decay):
    compare(
        grafted("adagrad", 0.2, grafting_epsilon=1e-3, weight_decay=weight_decay,
                weight_decay_type="l2"),
        lambda ps: torch.optim.Adagrad(ps, lr=0.2, eps=1e-3, weight_decay=weight_decay),
    )


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_rmsprop(momentum):
    compare(
        grafted("rmsprop", 0.01, grafting_beta2=0.9, grafting_epsilon=1e-4, momentum=momentum),
        lambda ps: torch.optim.RMSprop(ps, lr=0.01, alpha=0.9, eps=1e-4, momentum=momentum),
    )


@pytest.mark.parametrize("betas", [(0.9, 0.999), (0.5, 0.9)])
def test_adam(betas):
    compare(
        {
            "lr": 0.05,
            "betas": (betas[0], 1.0),
            "grafting": "adam",
            "grafting_beta2": betas[1],
            "grafting_epsilon": 1e-6,
        },
        lambda ps: torch.optim.Adam(ps, lr=0.05, betas=betas, eps=1e-6),
    )


#: Adam grafting with beta1 as momentum, as torch's Adam / AdamW with betas (0.9, 0.99)
ADAM_GRAFTED = {"lr": 0.05, "betas": (0.9, 1.0), "grafting": "adam", "grafting_beta2": 0.99}


def test_adam_l2_weight_decay():
    compare(
        {**ADAM_GRAFTED, "weight_decay": 0.1, "weight_decay_type": "l2"},
        lambda ps: torch.optim.Adam(ps, lr=0.05, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1),
    )


@pytest.mark.parametrize("lrs", [None, [0.05, 0.04, 0.02, 0.1, 0.01, 0.03]],
                         ids=["constant_lr", "lr_schedule"])
def test_adamw_decoupled_weight_decay(lrs):
    """'decoupled' multiplies wd by the current lr, like AdamW, also after the lr changed."""
    compare(
        {**ADAM_GRAFTED, "weight_decay": 0.3, "weight_decay_type": "decoupled"},
        lambda ps: torch.optim.AdamW(ps, lr=0.05, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.3),
        lrs=lrs,
    )


@pytest.mark.parametrize("betas", [(0.9, 0.999), (0.8, 0.95)])
def test_eigenvalue_corrected_without_preconditioning_is_adam(betas):
    compare(
        {
            "lr": 0.05,
            "betas": betas,
            "epsilon": 1e-6,
            "preconditioner": "eigenvalue_corrected",
            "grafting": None,
        },
        lambda ps: torch.optim.Adam(ps, lr=0.05, betas=betas, eps=1e-6),
    )


def test_eigenvalue_corrected_without_preconditioning_adamw():
    compare(
        {
            "lr": 0.05,
            "betas": (0.9, 0.99),
            "epsilon": 1e-6,
            "preconditioner": "eigenvalue_corrected",
            "weight_decay": 0.2,
        },
        lambda ps: torch.optim.AdamW(ps, lr=0.05, betas=(0.9, 0.99), eps=1e-6, weight_decay=0.2),
    )
