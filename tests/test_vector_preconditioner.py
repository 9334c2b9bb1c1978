"""``vector_preconditioner``: the kind of a group's vector-like parameters (biases, norm
weights), chosen inside the group, so a flat parameter list stays one group."""

from __future__ import annotations

import pytest
import torch

from hf_shampoo import DistributedShampoo
from hf_shampoo.describe_table import describe_rows
from tests.helpers import assert_resumes_exactly, train_mse

pytestmark = pytest.mark.unit


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.LayerNorm(10), torch.nn.Tanh(),
                               torch.nn.Linear(10, 3))


def _train(model, opt, steps=6, seed=0):
    train_mse(model, opt, steps, seed)


@pytest.mark.parametrize("config", [
    dict(lr=0.01, grafting="adam", betas=(0.9, 0.999), precondition_frequency=2),
    dict(lr=0.01, preconditioner="eigenvalue_corrected", betas=(0.9, 0.99), epsilon=1e-8),
])
def test_one_group_equals_the_split_into_matrices_and_diagonal_vectors(config):
    """The same numbers as two groups: the matrices with the group's kind, the vectors
    with "diagonal" (Adam grafting where the group has none)."""
    one = _model()
    opt = DistributedShampoo(one.parameters(), vector_preconditioner="diagonal", **config)
    assert len(opt.param_groups) == 1
    two = _model()
    vectors = [p for p in two.parameters() if p.dim() == 1]
    matrices = [p for p in two.parameters() if p.dim() > 1]
    split = DistributedShampoo(
        [{"params": matrices},
         {"params": vectors, "preconditioner": "diagonal",
          "grafting": config.get("grafting") or "adam"}], **config)
    _train(one, opt)
    _train(two, split)
    for a, b in zip(one.parameters(), two.parameters()):
        assert torch.equal(a.detach(), b.detach())
    rows = describe_rows(opt)
    assert [r["preconditioner"] for r in rows] == [
        config.get("preconditioner", "shampoo"), "diagonal", "diagonal", "diagonal",
        config.get("preconditioner", "shampoo"), "diagonal"]


def test_the_group_lr_governs_every_parameter_of_the_group():
    model = _model()
    opt = DistributedShampoo(model.parameters(), lr=0.01, grafting="adam",
                             vector_preconditioner="diagonal")
    _train(model, opt, 2)
    before = [p.detach().clone() for p in model.parameters()]
    opt.param_groups[0]["lr"] = 0.0
    _train(model, opt, 2, seed=1)
    assert all(torch.equal(p.detach(), b) for p, b in zip(model.parameters(), before))


def test_muon_in_one_group_vectors_by_adam():
    """Spectral descent refuses vectors, unless the group gives them another kind."""
    model = _model()
    with pytest.raises(ValueError, match="fewer than 2 dims"):
        DistributedShampoo(model.parameters(), preconditioner="spectral_descent")
    opt = DistributedShampoo(model.named_parameters(), lr=0.02,
                             preconditioner="spectral_descent", vector_preconditioner="diagonal")
    _train(model, opt, 3)
    kinds = {r["name"]: r["preconditioner"] for r in describe_rows(opt)}
    assert kinds["0.weight"] == "spectral_descent" and kinds["0.bias"] == "diagonal"
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("value, message", [
    ("spectral_descent", "invalid vector_preconditioner='spectral_descent'; expected one of"),
    ("adam", "invalid vector_preconditioner='adam'; expected one of 'shampoo'"),
])
def test_invalid_vector_preconditioner_is_refused(value, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        DistributedShampoo(_model().parameters(), vector_preconditioner=value)


def test_the_vector_settings_are_validated_too():
    # grafting_beta2=1 is valid without grafting, but the vectors get Adam grafting
    DistributedShampoo(_model().parameters(), grafting_beta2=1.0)
    with pytest.raises(ValueError, match="grafting_beta2=1.0; expected < 1 for 'adam' "
                                         r"\(for the vector-like parameters of a group with "
                                         "vector_preconditioner='diagonal'"):
        DistributedShampoo(_model().parameters(), vector_preconditioner="diagonal",
                           grafting_beta2=1.0)


def test_a_checkpoint_resumes_exactly():
    saved = assert_resumes_exactly(
        _model,
        lambda model: DistributedShampoo(model.parameters(), lr=0.01,
                                         vector_preconditioner="diagonal",
                                         precondition_frequency=2),
        lambda model, opt, steps, seed: _train(model, opt, steps, seed=seed))
    with pytest.raises(ValueError, match="vector_preconditioner"):
        DistributedShampoo(_model().parameters(), lr=0.01).load_state_dict(saved)
