"""Invalid input is refused early and clearly (docs/design.md §7)."""

import copy

import pytest
import torch

from hf_shampoo import DistributedShampoo

pytestmark = [pytest.mark.unit, pytest.mark.device]


def param(shape=(3, 4)):
    return torch.nn.Parameter(torch.randn(shape))


# (keyword, bad value, text of the bad value that the message must contain)
BAD = [
    ("lr", -0.1, "-0.1"),
    ("betas", (1.5, 0.9), "1.5"),
    ("betas", (-0.1, 0.9), "-0.1"),
    ("betas", (0.9, 1.5), "1.5"),
    ("betas", (0.9, -0.2), "-0.2"),
    ("beta3", 1.5, "1.5"),
    ("beta3", -0.5, "-0.5"),
    ("epsilon", -1e-3, "-0.001"),
    ("momentum", 1.0, "1.0"),
    ("momentum", -0.1, "-0.1"),
    ("dampening", 1.5, "1.5"),
    ("dampening", -0.1, "-0.1"),
    ("weight_decay", -0.01, "-0.01"),
    ("weight_decay_type", "fancy", "fancy"),
    ("max_preconditioner_dim", 0, "0"),
    ("precondition_frequency", 0, "0"),
    ("preconditioner", "kfac", "kfac"),
    ("eigendecomposition", "svd", "svd"),
    ("eigenbasis_tolerance", -0.1, "-0.1"),
    ("eigenbasis_tolerance", 1.5, "1.5"),
    ("qr_max_iterations", 0, "0"),
    ("inverse_exponent_override", {2: -0.5}, "-0.5"),
    ("inverse_exponent_override", {2: {0: -0.25}}, "-0.25"),
    ("grafting", "lion", "lion"),
    ("grafting_beta2", 1.5, "1.5"),
    ("grafting_beta2", -0.1, "-0.1"),
    ("grafting_epsilon", 0.0, "0.0"),
    ("grafting_epsilon", -1e-8, "-1e-08"),
    ("factor_matrix_dtype", torch.int32, "int32"),
    ("distributed", "fsdp2", "fsdp2"),
    ("num_trainers_per_group", 0, "0"),
    ("num_trainers_per_group", -2, "-2"),
    ("epsilon", 0.0, "0.0"),  # the perturbation needs epsilon > 0
    ("rank_deficient", "truncate", "truncate"),
    ("rank_atol", -1.0, "-1.0"),
    ("rank_rtol", -0.5, "-0.5"),
]


@pytest.mark.parametrize(("keyword", "value", "shown"), BAD, ids=[f"{k}={v!r}" for k, v, _ in BAD])
def test_bad_keyword(keyword, value, shown):
    with pytest.raises((ValueError, TypeError)) as info:
        DistributedShampoo([param()], **{keyword: value})
    message = str(info.value)
    assert keyword in message
    assert shown in message


def test_start_preconditioning_step_below_frequency():
    with pytest.raises((ValueError, TypeError), match="start_preconditioning_step"):
        DistributedShampoo([param()], precondition_frequency=5, start_preconditioning_step=2)


@pytest.mark.parametrize(
    ("keyword", "value"),
    [("lr", -1.0), ("betas", (0.9, 2.0)), ("grafting", "nope"), ("momentum", 1.5)],
)
def test_bad_value_in_param_group(keyword, value):
    with pytest.raises((ValueError, TypeError), match=keyword):
        DistributedShampoo([{"params": [param()]}, {"params": [param()], keyword: value}])


def test_unknown_keyword_in_param_group():
    with pytest.raises((ValueError, TypeError), match="learning_rate"):
        DistributedShampoo([{"params": [param()], "learning_rate": 0.1}])


def test_unknown_keyword_argument():
    with pytest.raises(TypeError):
        DistributedShampoo([param()], learning_rate=0.1)


def test_complex_parameter():
    p = torch.nn.Parameter(torch.zeros(3, dtype=torch.complex64))
    with pytest.raises(ValueError, match="complex"):
        DistributedShampoo([p])


def test_sparse_gradient():
    emb = torch.nn.Embedding(6, 3, sparse=True)
    opt = DistributedShampoo(emb.parameters())
    emb(torch.tensor([1, 2])).sum().backward()
    assert emb.weight.grad.is_sparse
    before = emb.weight.detach().clone()
    with pytest.raises(RuntimeError, match="sparse"):
        opt.step()
    assert torch.equal(emb.weight.detach(), before)


def test_add_param_group_with_bad_value_changes_nothing():
    p1, p2 = param(), param((5,))
    opt = DistributedShampoo([p1], lr=0.1)
    groups_before = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    groups_before = copy.deepcopy(groups_before)
    with pytest.raises((ValueError, TypeError), match="lr"):
        opt.add_param_group({"params": [p2], "lr": -1.0})
    assert len(opt.param_groups) == 1
    assert len(opt.param_groups[0]["params"]) == 1 and opt.param_groups[0]["params"][0] is p1
    assert [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups] == (
        groups_before
    )
    # the optimizer still works on its only parameter, and never touches p2
    p1.grad = torch.ones_like(p1)
    p2.grad = torch.ones_like(p2)
    p2_before = p2.detach().clone()
    p1_before = p1.detach().clone()
    opt.step()
    assert not torch.equal(p1.detach(), p1_before)
    assert torch.equal(p2.detach(), p2_before)


def test_add_param_group_with_unknown_keyword_changes_nothing():
    p1, p2 = param(), param((5,))
    opt = DistributedShampoo([p1])
    with pytest.raises((ValueError, TypeError)):
        opt.add_param_group({"params": [p2], "colour": "blue"})
    assert len(opt.param_groups) == 1


def test_valid_per_group_values_are_kept():
    p1, p2 = param(), param((5,))
    opt = DistributedShampoo(
        [{"params": [p1]}, {"params": [p2], "lr": 0.5, "grafting": "adam"}], lr=0.1
    )
    assert opt.param_groups[0]["lr"] == 0.1
    assert opt.param_groups[1]["lr"] == 0.5


def test_pseudo_inverse_takes_epsilon_zero_and_root_kinds_only():
    """Meta's rule: the pseudo-inverse replaces epsilon (it must be 0); the eigenvalue-
    corrected kind's epsilon is its second moment's, so it keeps the perturbation."""
    with pytest.raises(ValueError, match=r"epsilon.*1e-12.*expected 0.0 with rank_deficient="):
        DistributedShampoo([param()], rank_deficient="pseudo_inverse")
    with pytest.raises(ValueError, match=r"rank_deficient.*'shampoo', 'kl_shampoo'"):
        DistributedShampoo([param()], rank_deficient="pseudo_inverse", epsilon=0.0,
                           preconditioner="eigenvalue_corrected")
    for kind in ("shampoo", "kl_shampoo"):
        opt = DistributedShampoo([param()], rank_deficient="pseudo_inverse", epsilon=0.0,
                                 rank_rtol=None, preconditioner=kind)
        assert opt.param_groups[0]["rank_rtol"] is None
