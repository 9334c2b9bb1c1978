"""DistributedShampoo described with torch's own ``OptimizerInfo`` (the machinery of torch's
generic optimizer tests, shipped in the wheel) and checked against the contracts those tests
check for every torch optimizer: errors, progress, no-op steps without gradients or with
zero gradients, state_dict determinism and loading, weights-only save and load, step hooks,
deepcopy, per-group lr and weight decay, tensor lr, printing.

torch's ``test/test_optim.py`` itself is not in the wheel; this module imports only what
is (``common_optimizers`` needs the small ``expecttest`` package).
"""

from __future__ import annotations

import copy
import io

import pytest
import torch

from hf_shampoo import DistributedShampoo

pytestmark = pytest.mark.reference

common = pytest.importorskip("torch.testing._internal.common_optimizers",
                             reason="torch's optimizer test machinery needs expecttest")
ErrorOptimizerInput = common.ErrorOptimizerInput
OptimizerErrorEnum = common.OptimizerErrorEnum
OptimizerInfo = common.OptimizerInfo
OptimizerInput = common.OptimizerInput


def optim_inputs(device="cpu", dtype=None):
    return [
        OptimizerInput(params=None, kwargs={"lr": 0.05}, desc="defaults but lr"),
        OptimizerInput(params=None, kwargs={"lr": 0.02, "grafting": "adam",
                                            "betas": (0.9, 0.999), "weight_decay": 0.1},
                       desc="adam grafting, decoupled weight decay"),
        OptimizerInput(params=None, kwargs={"lr": torch.tensor(0.02), "grafting": "adam"},
                       desc="tensor lr"),
        OptimizerInput(params=None, kwargs={"lr": 0.01, "preconditioner": "eigenvalue_corrected",
                                            "betas": (0.9, 0.99), "epsilon": 1e-8},
                       desc="eigenvalue-corrected (SOAP)"),
        OptimizerInput(params=None, kwargs={"lr": 0.02, "preconditioner": "spectral_descent",
                                            "vector_preconditioner": "diagonal",
                                            "betas": (0.95, 1.0)},
                       desc="spectral descent (Muon), vectors by Adam"),
    ]


def optim_error_inputs(device="cpu", dtype=torch.float32):
    """torch's construction errors that every torch optimizer raises, then ours."""
    param = torch.nn.Parameter(torch.ones(3, 2, device=device, dtype=dtype))
    return common.get_error_inputs_for_all_optims(device, dtype) + [
        ErrorOptimizerInput(OptimizerInput(params=[param], kwargs={"lr": -1.0}),
                            error_type=ValueError, error_regex="invalid lr=-1.0"),
        ErrorOptimizerInput(OptimizerInput(params=[param], kwargs={"betas": (0.9, 1.5)}),
                            error_type=ValueError, error_regex="betas"),
        ErrorOptimizerInput(OptimizerInput(params=[param], kwargs={"epsilon": 0.0}),
                            error_type=ValueError, error_regex="invalid epsilon=0.0"),
        ErrorOptimizerInput(OptimizerInput(params=[param], kwargs={"lrr": 0.1}),
                            error_type=TypeError, error_regex="did you mean 'lr'"),
        ErrorOptimizerInput(OptimizerInput(params=[param], kwargs={"preconditioner": "x"}),
                            error_type=ValueError, error_regex="invalid preconditioner='x'"),
    ]


SHAMPOO_INFO = OptimizerInfo(
    DistributedShampoo, optim_inputs_func=optim_inputs,
    optim_error_inputs_func=optim_error_inputs, supported_impls=(),
    not_og_supported_flags=(), supports_complex=False, supports_multiple_devices=False,
)
INPUTS = SHAMPOO_INFO.optim_inputs_func(device="cpu")


def _params(contiguous=True):
    torch.manual_seed(0)
    if contiguous:
        return torch.nn.Parameter(torch.randn(10, 5)), torch.nn.Parameter(torch.randn(10))
    return (torch.nn.Parameter(torch.randn(10, 5, 2)[..., 0]),
            torch.nn.Parameter(torch.randn(10, 2)[..., 0]))


def _closure(optimizer, weight, bias, x):
    def closure():
        optimizer.zero_grad()
        loss = (weight.mv(x) + bias).pow(2).sum()
        loss.backward()
        return loss
    return closure


def _kwargs(optim_input):
    return copy.deepcopy(optim_input.kwargs)


@pytest.mark.parametrize("error_input", SHAMPOO_INFO.optim_error_inputs_func(),
                         ids=lambda e: e.error_regex[:40])
def test_errors(error_input):
    """As torch's generic test: the declared error (or warning) at construction or step."""
    optim_input = error_input.optimizer_error_input
    params = optim_input.params
    if params is None:
        params = [torch.nn.Parameter(torch.ones(3, 2))]
    expect = pytest.warns if issubclass(error_input.error_type, Warning) else pytest.raises
    if error_input.error_on == OptimizerErrorEnum.CONSTRUCTION_ERROR:
        with expect(error_input.error_type, match=error_input.error_regex):
            DistributedShampoo(params, **optim_input.kwargs)
    else:
        optimizer = DistributedShampoo(params, **optim_input.kwargs)
        with expect(error_input.error_type, match=error_input.error_regex):
            optimizer.step()


@pytest.mark.parametrize("contiguous", [True, False])
@pytest.mark.parametrize("optim_input", INPUTS, ids=lambda i: i.desc)
def test_goes_right_direction(optim_input, contiguous):
    weight, bias = _params(contiguous)
    optimizer = DistributedShampoo([weight, bias], **_kwargs(optim_input))
    closure = _closure(optimizer, weight, bias, torch.randn(5))
    initial = closure().item()
    for _ in range(20):
        optimizer.step(closure)
    assert closure().item() < initial


@pytest.mark.parametrize("optim_input", INPUTS, ids=lambda i: i.desc)
def test_steps_without_gradients_or_with_zero_gradients_change_nothing(optim_input):
    weight, bias = _params()
    kwargs = _kwargs(optim_input)
    kwargs.pop("weight_decay", None)  # decay moves parameters whatever the gradient
    optimizer = DistributedShampoo([weight, bias], **kwargs)
    before = [weight.detach().clone(), bias.detach().clone()]
    optimizer.step()  # no gradient at all
    weight.grad, bias.grad = torch.zeros_like(weight), torch.zeros_like(bias)
    optimizer.step()
    assert torch.equal(weight, before[0]) and torch.equal(bias, before[1])


@pytest.mark.parametrize("optim_input", INPUTS, ids=lambda i: i.desc)
def test_state_dict_is_deterministic_loads_and_survives_weights_only(optim_input):
    weight, bias = _params()
    x = torch.randn(5)
    optimizer = DistributedShampoo([weight, bias], **_kwargs(optim_input))
    for _ in range(6):
        optimizer.step(_closure(optimizer, weight, bias, x))
    weight_c = torch.nn.Parameter(weight.detach().clone())
    bias_c = torch.nn.Parameter(bias.detach().clone())
    clone = DistributedShampoo([weight_c, bias_c], **_kwargs(optim_input))
    buffer = io.BytesIO()
    torch.save(optimizer.state_dict(), buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    clone.load_state_dict(saved)
    for _ in range(6):
        optimizer.step(_closure(optimizer, weight, bias, x))
        clone.step(_closure(clone, weight_c, bias_c, x))
        assert torch.equal(weight, weight_c) and torch.equal(bias, bias_c)
    mine, theirs = optimizer.state_dict(), clone.state_dict()
    assert mine["param_groups"] == theirs["param_groups"]
    assert all(torch.equal(mine["state"][i][k], theirs["state"][i][k])
               for i in mine["state"] for k in mine["state"][i])


def test_step_hooks_deepcopy_and_printing():
    weight, bias = _params()
    optimizer = DistributedShampoo([weight, bias], **_kwargs(INPUTS[1]))
    calls = []
    optimizer.register_step_pre_hook(lambda opt, args, kwargs: calls.append("pre"))
    optimizer.register_step_post_hook(lambda opt, args, kwargs: calls.append("post"))
    optimizer.step(_closure(optimizer, weight, bias, torch.randn(5)))
    assert calls == ["pre", "post"]
    assert "DistributedShampoo (" in repr(optimizer) and "Parameter Group 0" in repr(optimizer)
    twin = copy.deepcopy(optimizer)
    assert twin.state_dict()["param_groups"] == optimizer.state_dict()["param_groups"]


def test_tensor_lr_equals_float_lr():
    results = []
    for lr in (0.02, torch.tensor(0.02)):
        weight, bias = _params()
        optimizer = DistributedShampoo([weight, bias], lr=lr, grafting="adam")
        closure = _closure(optimizer, weight, bias, torch.ones(5))
        for _ in range(4):
            optimizer.step(closure)
        results.append((weight.detach().clone(), bias.detach().clone()))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


def test_each_group_has_its_own_lr_and_weight_decay():
    weight, bias = _params()
    optimizer = DistributedShampoo([{"params": [weight], "lr": 0.0, "weight_decay": 0.5},
                                    {"params": [bias], "lr": 0.05}], grafting="adam")
    before = [weight.detach().clone(), bias.detach().clone()]
    for _ in range(3):
        optimizer.step(_closure(optimizer, weight, bias, torch.randn(5)))
    assert torch.equal(weight, before[0])  # lr 0: neither the step nor the decay moves it
    assert not torch.equal(bias, before[1])
