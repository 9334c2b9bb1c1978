"""docs/design.md §6: state_dict() round-trips through torch.save /
torch.load(weights_only=True) and a resumed run continues exactly (bit for bit) as the run
that never stopped."""

import io

import pytest
import torch

from hf_shampoo import DistributedShampoo
from tests.helpers import generator

pytestmark = [pytest.mark.unit, pytest.mark.device]

SHAPES = {"w": (5, 4), "conv": (3, 2, 2, 2), "b": (5,), "s": ()}


def make_params(shapes=SHAPES, seed=0):
    gen = generator(seed)
    return {
        name: torch.nn.Parameter(torch.randn(shape, generator=gen))
        for name, shape in shapes.items()
    }


def grads_for(params, step):
    gen = generator(1000 + step)
    return {name: torch.randn(p.shape, generator=gen) for name, p in params.items()}


def do_steps(params, opt, first, last):
    for t in range(first, last):
        for name, g in grads_for(params, t).items():
            params[name].grad = g
        opt.step()


def roundtrip(obj):
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


CONFIGS = {
    "shampoo": {"max_preconditioner_dim": 4},
    "shampoo-graft-momentum": {
        "max_preconditioner_dim": 4,
        "grafting": "adam",
        "momentum": 0.9,
        "nesterov": True,
        "weight_decay": 0.01,
        "betas": (0.9, 0.99),
        "beta3": 0.8,
        "precondition_frequency": 2,
        "start_preconditioning_step": 3,
    },
    "eigenvalue-corrected": {
        "max_preconditioner_dim": 4,
        "preconditioner": "eigenvalue_corrected",
        "betas": (0.9, 0.99),
        "precondition_frequency": 2,
        "start_preconditioning_step": 2,
    },
    "eigenvalue-corrected-qr": {
        "max_preconditioner_dim": 4,
        "preconditioner": "eigenvalue_corrected",
        "eigendecomposition": "qr",
        "qr_max_iterations": 2,
        "eigenbasis_tolerance": 0.1,
        "betas": (0.9, 0.99),
        "grafting": "rmsprop",
        "momentum": 0.5,
        "precondition_frequency": 3,
        "start_preconditioning_step": 3,
    },
    "kl-shampoo": {
        "max_preconditioner_dim": 4,
        "preconditioner": "kl_shampoo",
        "grafting": "adam",
        "betas": (0.9, 0.99),
        "precondition_frequency": 2,
    },
}


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("saved_at", [2, 3, 4])  # before, at and after a refresh boundary
def test_resume_is_bit_identical(name, saved_at):
    config = {"lr": 0.05, **CONFIGS[name]}
    total = 8

    params = make_params()
    opt = DistributedShampoo(list(params.values()), **config)
    do_steps(params, opt, 0, total)
    uninterrupted = {k: p.detach().clone() for k, p in params.items()}

    first = make_params()
    opt_first = DistributedShampoo(list(first.values()), **config)
    do_steps(first, opt_first, 0, saved_at)
    saved_state = roundtrip(opt_first.state_dict())
    saved_params = roundtrip({k: p.detach() for k, p in first.items()})
    del opt_first, first

    resumed = make_params(seed=123)  # fresh model, other initial values
    with torch.no_grad():
        for k, p in resumed.items():
            p.copy_(saved_params[k])
    opt_resumed = DistributedShampoo(list(resumed.values()), **config)
    opt_resumed.load_state_dict(saved_state)
    do_steps(resumed, opt_resumed, saved_at, total)

    for k in params:
        assert torch.equal(resumed[k].detach(), uninterrupted[k]), k
    assert not torch.equal(uninterrupted["w"], make_params()["w"])


def test_state_dict_of_fresh_optimizer_loads():
    config = {"lr": 0.05, **CONFIGS["shampoo-graft-momentum"]}
    a, b = make_params(), make_params()
    opt_a = DistributedShampoo(list(a.values()), **config)
    opt_b = DistributedShampoo(list(b.values()), **config)
    opt_b.load_state_dict(roundtrip(opt_a.state_dict()))
    do_steps(a, opt_a, 0, 4)
    do_steps(b, opt_b, 0, 4)
    for k in a:
        assert torch.equal(a[k].detach(), b[k].detach()), k


def test_state_dict_is_weights_only_loadable_and_param_groups_plain():
    params = make_params()
    opt = DistributedShampoo(list(params.values()), **CONFIGS["eigenvalue-corrected-qr"])
    do_steps(params, opt, 0, 3)
    loaded = roundtrip(opt.state_dict())
    assert len(loaded["param_groups"]) == 1


def test_load_restores_step_count():
    """After loading, bias corrections and the refresh schedule continue from the saved step:
    loading a state saved after 3 steps differs from not loading at all."""
    config = {"lr": 0.05, **CONFIGS["shampoo-graft-momentum"]}
    a = make_params()
    opt_a = DistributedShampoo(list(a.values()), **config)
    do_steps(a, opt_a, 0, 3)
    state = roundtrip(opt_a.state_dict())
    b, c = make_params(), make_params()
    opt_b = DistributedShampoo(list(b.values()), **config)
    opt_b.load_state_dict(state)
    opt_c = DistributedShampoo(list(c.values()), **config)
    do_steps(b, opt_b, 3, 4)
    do_steps(c, opt_c, 3, 4)
    assert not torch.equal(b["w"].detach(), c["w"].detach())


def saved_state_for(shapes, **config):
    params = make_params(shapes)
    opt = DistributedShampoo(list(params.values()), **config)
    do_steps(params, opt, 0, 2)
    return roundtrip(opt.state_dict())


@pytest.mark.parametrize(
    ("other_shapes", "other_config"),
    [
        pytest.param(
            {"w": (4, 5), "conv": (3, 2, 2, 2), "b": (5,), "s": ()}, {}, id="transposed-shape"
        ),
        pytest.param(
            {"w": (5, 4), "conv": (3, 2, 2, 2), "b": (6,), "s": ()}, {}, id="other-1d-size"
        ),
        pytest.param({"w": (5, 4), "conv": (3, 2, 2, 2), "b": (5,)}, {}, id="fewer-params"),
        pytest.param({**SHAPES, "extra": (2, 2)}, {}, id="more-params"),
        pytest.param(SHAPES, {"max_preconditioner_dim": 3}, id="other-max-dim"),
        pytest.param({"w": (6, 6)}, {"max_preconditioner_dim": 3}, id="same-block-count"),
    ],
)
def test_load_refuses_mismatch(other_shapes, other_config):
    if other_shapes == {"w": (6, 6)}:
        # (6, 6) gives 4 blocks both with 3 and with 4, but of other shapes
        state = saved_state_for({"w": (6, 6)}, max_preconditioner_dim=4)
    else:
        state = saved_state_for(SHAPES, max_preconditioner_dim=4)
    params = make_params(other_shapes)
    config = {"max_preconditioner_dim": 4, **other_config}
    opt = DistributedShampoo(list(params.values()), **config)
    with pytest.raises(ValueError):
        opt.load_state_dict(state)


def test_load_refuses_a_block_missing_one_of_its_tensors():
    """A state whose block lacks one of the tensors its kind keeps is refused, and nothing
    changes: it used to load, leaving that tensor at its initial value (zeros for a
    factor), so that the run went on from a state no run had."""
    state = saved_state_for(SHAPES, max_preconditioner_dim=4)
    index = next(i for i, entry in state["state"].items() if "block_0.factor_matrix_0" in entry)
    del state["state"][index]["block_0.factor_matrix_0"]
    params = make_params()
    opt = DistributedShampoo(list(params.values()), max_preconditioner_dim=4)
    do_steps(params, opt, 0, 1)
    before = roundtrip(opt.state_dict())
    with pytest.raises(ValueError, match="block 0 lacks its factor_matrix_0"):
        opt.load_state_dict(state)
    after = opt.state_dict()
    assert after["param_groups"] == before["param_groups"]
    for index, entry in before["state"].items():
        assert all(torch.equal(after["state"][index][k], t) for k, t in entry.items())


def test_load_sharded_refuses_a_checkpoint_with_other_state_tensors(tmp_path, monkeypatch):
    """``load_sharded`` reads every tensor saved for this rank's blocks: a checkpoint whose
    blocks keep others under the same settings (here 4-bit factors quantised below the
    library's floor when saved, unquantised when loaded) is refused, naming a tensor this
    optimizer does not keep, where it used to load the tensors both have and leave the
    rest at their initial values. Found by the generated DDP cases (a resume that built its
    optimizer outside the floor the saving run had)."""
    from hf_shampoo import quantization
    from hf_shampoo.checkpoint import load_sharded, save_sharded

    if torch.device(generator(0).device).type != "cpu":
        pytest.skip("torch.distributed.checkpoint in one process: CPU tensors")
    config = dict(max_preconditioner_dim=4, quantization="4bit", statistics_frequency=1,
                  precondition_frequency=1)
    params = make_params()
    monkeypatch.setattr(quantization, "MIN_QUANTIZED_ELEMENTS", 16)
    opt = DistributedShampoo(list(params.values()), **config)
    do_steps(params, opt, 0, 2)
    save_sharded(opt, tmp_path / "ckpt")
    monkeypatch.undo()
    fresh = DistributedShampoo(list(make_params().values()), **config)
    with pytest.raises(ValueError, match="has unexpected state 'factor_eigenvalues_0'"):
        load_sharded(fresh, tmp_path / "ckpt")


def test_state_dict_groups_do_not_share_nested_values_with_the_optimizer():
    """``dcp.load`` fills a state dict's nested values in place: the optimizer's own
    groups must not change with them (it wrote ``"2"`` beside ``2`` into
    ``inverse_exponent_override``, and the next load refused the group)."""
    params = make_params({"w": (6, 4)})
    opt = DistributedShampoo(params.values(), inverse_exponent_override={2: {0: 0}})
    saved = opt.state_dict()["param_groups"][0]["inverse_exponent_override"]
    saved["2"] = {"0": 0}
    saved[2][1] = 0
    assert opt.param_groups[0]["inverse_exponent_override"] == {2: {0: 0}}


@pytest.mark.parametrize("name", ["shampoo-graft-momentum", "eigenvalue-corrected"])
def test_torch_flattened_state_dict_loads_into_a_fresh_optimizer(name):
    """torch's ``set_optimizer_state_dict(..., flatten_optimizer_state_dict=True)`` takes
    each parameter's state names from ``optimizer.state[p]``: into an optimizer that has
    not stepped (nor been asked for its state) it loaded nothing, silently. It resumes
    bit-identically now."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    options = StateDictOptions(flatten_optimizer_state_dict=True)
    params = make_params()
    model = torch.nn.ParameterDict(params)
    opt = DistributedShampoo(model.parameters(), **CONFIGS[name])
    do_steps(params, opt, 1, 4)
    saved = get_optimizer_state_dict(model, opt, options=options)
    fresh_params = {n: torch.nn.Parameter(p.detach().clone()) for n, p in params.items()}
    fresh_model = torch.nn.ParameterDict(fresh_params)
    fresh = DistributedShampoo(fresh_model.parameters(), **CONFIGS[name])
    set_optimizer_state_dict(fresh_model, fresh, saved, options=options)
    assert sum(len(fresh.state[p]) for p in fresh_params.values()) == sum(
        len(opt.state[p]) for p in params.values()) > 0
    do_steps(params, opt, 4, 7)
    do_steps(fresh_params, fresh, 4, 7)
    for n in params:
        assert torch.equal(params[n], fresh_params[n]), n
