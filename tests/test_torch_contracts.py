"""The contracts of ``torch.optim.Optimizer`` that tools rely on: a step never touches the
user's gradients, copies continue exactly, state-dict hooks, saved parameter names, clear
errors for unknown keywords."""

from __future__ import annotations

import contextlib
import copy
import io
import pickle

import pytest
import torch

from hf_shampoo import DistributedShampoo
from hf_shampoo.preconditioners import KINDS, QUANTIZED_KINDS
from tests.helpers import generator, train_mse

pytestmark = pytest.mark.reference

CONFIG = dict(lr=0.02, grafting="adam", precondition_frequency=3, max_preconditioner_dim=8)


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 12), torch.nn.Tanh(), torch.nn.Linear(12, 3))


def _train(model, opt, steps, seed):
    train_mse(model, opt, steps, seed, batch=6, features=5)


def _pickled(obj):
    return pickle.loads(pickle.dumps(obj))


#: every preconditioner kind (vectors by Adam where a kind takes matrices only), its 4-bit
#: form where it has one, and the configurations that write into the stacked gradients
EVERY_KIND = {name: dict(preconditioner=name, vector_preconditioner="diagonal")
              for name in KINDS}
EVERY_KIND.update({f"{name}, 4bit": dict(preconditioner=name, quantization="4bit")
                   for name in QUANTIZED_KINDS})
EVERY_KIND["shampoo, l2 decay"] = dict(weight_decay=0.01, weight_decay_type="l2",
                                       grafting="adam")
EVERY_KIND["shampoo, decay, nesterov"] = dict(weight_decay=0.01, momentum=0.9,
                                              nesterov=True, grafting="adam")


def _adapted_params():
    """A LoRA-adapted layer (peft's names, so that ``riemannian_lora`` pairs its factors),
    its bias and a head."""
    gen = generator(0)
    shapes = {"base.weight": (12, 5), "base.bias": (12,), "base.lora_A.default.weight": (2, 5),
              "base.lora_B.default.weight": (12, 2), "head.weight": (3, 12)}
    return {name: torch.nn.Parameter(torch.randn(shape, generator=gen) * 0.3)
            for name, shape in shapes.items()}


def _adapted_loss(p, x):
    weight = p["base.weight"] + p["base.lora_B.default.weight"] @ p["base.lora_A.default.weight"]
    return (torch.tanh(x @ weight.T + p["base.bias"]) @ p["head.weight"].T).square().mean()


@pytest.mark.parametrize("set_to_none", [False, True], ids=["kept", "fresh"])
@pytest.mark.parametrize("config", list(EVERY_KIND.values()), ids=list(EVERY_KIND))
def test_a_step_never_replaces_or_writes_a_gradient(config, set_to_none):
    """torch's ``test_grads_are_never_inplaced_into`` for every kind, over steps past a
    refresh: after ``step()`` every ``p.grad`` is the tensor it was, with its ``_version``
    and its values. With ``zero_grad(set_to_none=False)`` between steps it is one tensor
    from the first backward to the last step, as with torch's optimizers."""
    params = _adapted_params()
    opt = DistributedShampoo(list(params.items()), lr=0.01, precondition_frequency=2,
                             start_preconditioning_step=2, **config)
    x = torch.randn(7, 5, generator=generator(1))
    first = None
    for _ in range(5):
        opt.zero_grad(set_to_none=set_to_none)
        _adapted_loss(params, x).backward()
        grads = {name: p.grad for name, p in params.items()}
        first = first or grads
        seen = {name: (g._version, g.clone()) for name, g in grads.items()}
        opt.step()
        for name, p in params.items():
            assert p.grad is grads[name], f"step() replaced {name}'s gradient"
            assert p.grad._version == seen[name][0], f"step() wrote into {name}'s gradient"
            assert torch.equal(p.grad, seen[name][1]), name
            if not set_to_none:
                assert p.grad is first[name], f"{name}'s gradient is not the one it was"


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
@pytest.mark.parametrize("config", [CONFIG, dict(CONFIG, preconditioner="eigenvalue_corrected",
                                                 grafting=None, epsilon=1e-8),
                                    dict(lr=0.02, preconditioner="spectral_descent")])
def test_a_copy_continues_exactly_like_the_original(how, config):
    if config.get("preconditioner") == "spectral_descent":
        model = torch.nn.Sequential(torch.nn.Linear(5, 12, bias=False), torch.nn.Tanh(),
                                    torch.nn.Linear(12, 3, bias=False))
    else:
        model = _model()
    opt = DistributedShampoo(model.parameters(), **config)
    _train(model, opt, 4, seed=0)  # past a refresh (t = 3)
    # copy model and optimizer together, as torch's tests do, so the copy's groups hold
    # the copied parameters
    twin_model, twin_opt = (copy.deepcopy if how == "deepcopy" else _pickled)((model, opt))
    assert twin_opt.state_dict()["state"].keys() == opt.state_dict()["state"].keys()
    _train(model, opt, 4, seed=1)
    _train(twin_model, twin_opt, 4, seed=1)
    for a, b in zip(model.parameters(), twin_model.parameters()):
        assert torch.equal(a.detach(), b.detach())
    mine, theirs = opt.state_dict()["state"], twin_opt.state_dict()["state"]
    assert all(torch.equal(mine[i][k], theirs[i][k]) for i in mine for k in mine[i])


def test_a_copy_before_the_first_step_works():
    model = _model()
    opt = DistributedShampoo(model.parameters(), **CONFIG)
    twin_model, twin_opt = copy.deepcopy((model, opt))
    _train(model, opt, 2, seed=0)
    _train(twin_model, twin_opt, 2, seed=0)
    for a, b in zip(model.parameters(), twin_model.parameters()):
        assert torch.equal(a.detach(), b.detach())


def test_state_dict_hooks_run_as_in_torch():
    model = _model()
    opt = DistributedShampoo(model.parameters(), **CONFIG)
    _train(model, opt, 1, seed=0)
    calls = []
    opt.register_state_dict_pre_hook(lambda o: calls.append(("pre", o is opt)))

    def post(o, state_dict):
        calls.append(("post", "state" in state_dict))
        state_dict["extra"] = "added by a hook"
        return state_dict

    opt.register_state_dict_post_hook(post)
    saved = opt.state_dict()
    assert calls == [("pre", True), ("post", True)] and saved["extra"] == "added by a hook"

    def load_pre(o, state_dict):
        calls.append(("load_pre", state_dict.get("extra")))
        state_dict = dict(state_dict)
        state_dict.pop("extra")
        return state_dict

    opt.register_load_state_dict_pre_hook(load_pre)
    opt.register_load_state_dict_post_hook(lambda o: calls.append(("load_post", o is opt)))
    opt.load_state_dict(saved)
    assert calls[2:] == [("load_pre", "added by a hook"), ("load_post", True)]


def test_state_dict_hooks_order_and_removal_as_in_torch():
    """Hooks registered with torch's public methods run in torch's order (``prepend=True``
    first) and stop running once their handle is removed, as with torch's SGD."""
    def calls_of(opt: torch.optim.Optimizer) -> list[str]:
        calls: list[str] = []
        handles = []
        for kind in ("state_dict_pre", "state_dict_post", "load_state_dict_pre",
                     "load_state_dict_post"):
            register = getattr(opt, f"register_{kind}_hook")
            for name, prepend in (("a", False), ("b", True), ("c", False)):
                handles.append(register(
                    lambda *args, _n=f"{kind}:{name}": calls.append(_n), prepend=prepend))
        opt.load_state_dict(opt.state_dict())
        handles[0].remove()  # state_dict_pre:a
        opt.state_dict()
        return calls

    model = _model()
    ours = DistributedShampoo(model.parameters(), **CONFIG)
    _train(model, ours, 1, seed=0)
    torchs = torch.optim.SGD(_model().parameters(), lr=0.1)
    assert calls_of(ours) == calls_of(torchs)
    assert calls_of(torchs)[:3] == ["state_dict_pre:b", "state_dict_pre:a", "state_dict_pre:c"]


def test_saved_param_names_survive_a_load_into_unnamed_groups():
    model = _model()
    named = DistributedShampoo(model.named_parameters(), **CONFIG)
    _train(model, named, 1, seed=0)
    buffer = io.BytesIO()
    torch.save(named.state_dict(), buffer)
    buffer.seek(0)
    unnamed = DistributedShampoo(model.parameters(), **CONFIG)
    unnamed.load_state_dict(torch.load(buffer, weights_only=True))
    assert unnamed.param_groups[0]["param_names"] == [n for n, _ in model.named_parameters()]
    assert unnamed.state_dict()["param_groups"][0]["param_names"] == \
        named.state_dict()["param_groups"][0]["param_names"]


def test_an_unknown_keyword_lists_the_valid_ones():
    with pytest.raises(TypeError) as info:
        DistributedShampoo([torch.nn.Parameter(torch.ones(2))], lr=0.1, betas2=(0.9, 0.99))
    message = str(info.value)
    assert "'betas2' (did you mean 'betas'?)" in message
    assert "valid keywords are params, lr, betas" in message and "check_finite_gradients" in message


@pytest.mark.parametrize("key, value, allowed", [
    ("lr", float("inf"), "expected a finite real number >= 0.0"),
    ("lr", -1.0, "expected a finite real number >= 0.0"),
    ("epsilon", float("inf"), "expected a finite real number > 0.0"),
    ("weight_decay", float("nan"), "expected a finite real number >= 0.0"),
    ("momentum", 1.0, "expected a finite real number in [0.0, 1.0)"),
])
def test_range_messages_say_exactly_what_is_allowed(key, value, allowed):
    with pytest.raises(ValueError) as info:
        DistributedShampoo([torch.nn.Parameter(torch.ones(2))], **{key: value})
    assert f"invalid {key}={value!r}; {allowed}" in str(info.value)


def test_optimizer_state_maps_each_parameter_to_views_of_its_state():
    model = _model()
    opt = DistributedShampoo(model.parameters(), **CONFIG)
    assert len(opt.state) == 0 and bool(opt.state)  # never falsy (see state_view.py)
    _train(model, opt, 3, seed=0)
    params = list(model.parameters())
    assert len(opt.state) == len(params) and set(map(id, opt.state)) == set(map(id, params))
    saved = opt.state_dict()["state"]
    for index, p in enumerate(params):
        entry = opt.state[p]
        assert p in opt.state and entry.keys() == saved[index].keys()
        assert all(torch.equal(entry[k], saved[index][k]) for k in entry)
    # the torch idiom: walk the values and change state through them
    for entry in opt.state.values():
        for key, tensor in entry.items():
            if key.endswith("grafting_state"):
                entry[key] = torch.zeros_like(tensor)  # copied into the storage
    reset = opt.state_dict()["state"]
    assert all(not reset[i][k].any() for i in reset for k in reset[i]
               if k.endswith("grafting_state"))
    stranger = torch.nn.Parameter(torch.ones(1))
    assert opt.state[stranger] == {} and stranger not in opt.state  # empty, not added
    # a tool's own key (timm's Lookahead keeps its slow weights so) is kept, and saved
    opt.state[params[0]]["slow"] = torch.full((2,), 7.0)
    opt.state[params[0]].setdefault("count", 3)
    assert torch.equal(opt.state[params[0]]["slow"], torch.full((2,), 7.0))
    assert opt.state[params[0]]["count"] == 3
    assert opt.state_dict()["state"][0]["count"] == 3
    with pytest.raises(KeyError, match="cannot be deleted"):
        del opt.state[params[0]][next(iter(saved[0]))]
    del opt.state[params[0]]["slow"]
    assert "slow" not in opt.state[params[0]]


def test_a_loop_over_optimizer_state_builds_its_map_once():
    """optimizer.state[p] is O(1): a loop over every parameter, reading, checking and
    writing in place, builds the map of views once (it used to rebuild it on every access,
    quadratic in the parameters); a step that allocates no state keeps it."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(30)])
    opt = DistributedShampoo(model.parameters(), **CONFIG)
    params = list(model.parameters())
    gen = generator(0)
    for _ in range(4):  # past the first refresh, which allocates the roots
        opt.zero_grad()
        model(torch.randn(3, 4, generator=gen)).square().sum().backward()
        opt.step()
    before = opt.state.rebuilds
    for p in params:
        entry = opt.state[p]
        assert p in opt.state and entry
        for tensor in entry.values():
            tensor.mul_(1.0)
    assert opt.state.rebuilds - before == 1
    opt.zero_grad()
    model(torch.randn(3, 4, generator=gen)).square().sum().backward()
    opt.step()
    for p in params:
        opt.state[p]
    assert opt.state.rebuilds - before == 1
    assert len(opt.state) == len(params)


def test_optimizer_state_follows_layout_and_state_changes():
    """The kept map is rebuilt when the state's tensors change: the first step allocates
    them, a load replaces them, a new param group adds blocks."""
    model = _model()
    opt = DistributedShampoo(model.parameters(), **CONFIG)
    first = list(model.parameters())[0]
    assert first not in opt.state
    _train(model, opt, 1, seed=0)
    assert first in opt.state
    saved = opt.state_dict()
    key = next(iter(opt.state[first]))
    fresh = DistributedShampoo(model.parameters(), **CONFIG)
    assert first not in fresh.state and len(fresh.state) == 0
    fresh.load_state_dict(saved)
    assert torch.equal(fresh.state[first][key], opt.state[first][key])
    opt.state[first][key].zero_()  # in place: the view is the storage
    assert not opt.state_dict()["state"][0][key].any()
    extra = torch.nn.Parameter(torch.randn(3, 2))
    opt.add_param_group({"params": [extra]})
    extra.grad = torch.randn(3, 2)
    opt.step()
    assert extra in opt.state and any(k.startswith("block_0.") for k in opt.state[extra])


def test_optimizer_state_omits_frozen_parameters():
    model = _model()
    model[0].requires_grad_(False)
    opt = DistributedShampoo(model.parameters(), **CONFIG)
    _train(model, opt, 2, seed=0)
    assert set(map(id, opt.state)) == set(map(id, model[2].parameters()))


def test_a_tensor_listed_twice_is_one_parameter_keyed_by_identity():
    """As torch: a repeated tensor (torch warns) has one state entry, under the index of
    its first position, and is updated once per step."""
    gen = generator(3)
    init_p, init_q = torch.randn(4, 3, generator=gen), torch.randn(5, generator=gen)
    grads = [(torch.randn(4, 3, generator=gen), torch.randn(5, generator=gen))
             for _ in range(4)]

    def run(listed_twice: bool):
        p, q = torch.nn.Parameter(init_p.clone()), torch.nn.Parameter(init_q.clone())
        with pytest.warns(UserWarning, match="duplicate") if listed_twice else \
                contextlib.nullcontext():
            opt = DistributedShampoo([p, p, q] if listed_twice else [p, q], **CONFIG)
        for gp, gq in grads:
            p.grad, q.grad = gp.clone(), gq.clone()
            opt.step()
        return p, q, opt

    p, q, opt = run(True)
    p1, q1, once = run(False)
    assert torch.equal(p.detach(), p1.detach()) and torch.equal(q.detach(), q1.detach())
    saved = opt.state_dict()
    assert saved["param_groups"][0]["params"] == [0, 0, 2]
    assert sorted(saved["state"]) == [0, 2]
    assert all(torch.equal(saved["state"][0][k], once.state_dict()["state"][0][k])
               for k in saved["state"][0])
    with pytest.warns(UserWarning, match="duplicate"):
        again = DistributedShampoo([p, p, q], **CONFIG)
    again.load_state_dict(saved)
    assert again.state_dict()["state"].keys() == saved["state"].keys()


def test_timm_lookahead_around_shampoo_keeps_its_slow_weights():
    """timm's Lookahead stores slow weights in the base optimizer's state every k steps."""
    from timm.optim import Lookahead

    model = _model()
    opt = Lookahead(DistributedShampoo(model.parameters(), **CONFIG), k=2, alpha=0.5)
    _train(model, opt, 5, seed=0)
    base = opt._base_optimizer
    assert all("lookahead_slow_buff" in base.state[p] for p in model.parameters())
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_timm_lookahead_resumes_exactly_with_its_slow_weights():
    """Keys a tool stores under a parameter are saved with that parameter's state-dict
    entry and restored by load_state_dict, as torch does: Lookahead resumes exactly."""
    from timm.optim import Lookahead

    model = _model()
    opt = Lookahead(DistributedShampoo(model.parameters(), **CONFIG), k=2, alpha=0.5)
    _train(model, opt, 5, seed=0)
    saved = copy.deepcopy(opt.state_dict())
    assert all("lookahead_slow_buff" in entry for entry in saved["state"].values())
    other = copy.deepcopy(model)
    resumed = Lookahead(DistributedShampoo(other.parameters(), **CONFIG), k=2, alpha=0.5)
    resumed.load_state_dict(saved)
    _train(model, opt, 4, seed=1)
    _train(other, resumed, 4, seed=1)
    for p, q in zip(model.parameters(), other.parameters()):
        assert torch.equal(p, q)


def test_keys_that_are_not_parameters_live_in_optimizer_state_as_in_torch():
    """torch's hook tests store flags in ``optimizer.state``: they appear in
    ``state_dict()["state"]`` and come back into ``optimizer.state`` on load."""
    model = _model()
    opt = DistributedShampoo(model.parameters(), **CONFIG)
    _train(model, opt, 1, seed=0)
    opt.register_state_dict_pre_hook(lambda o: o.state.__setitem__("test", 1))
    saved = opt.state_dict()
    assert saved["state"]["test"] == 1 and opt.state["test"] == 1 and "test" in opt.state
    other = DistributedShampoo(model.parameters(), **CONFIG)
    other.load_state_dict(saved)
    assert other.state["test"] == 1
    with pytest.raises(TypeError, match="view of the optimizer's state"):
        opt.state[next(model.parameters())] = {}


def test_a_state_that_names_its_parameters_loads_completely():
    """torch.optim.Optimizer.load_state_dict maps whatever ids the saved groups list
    (torch's distributed state-dict helpers list fully qualified names, not indices):
    such a state loads completely and the run continues exactly, while a string key that
    names no saved parameter still goes into ``optimizer.state``."""
    model = _model()
    opt = DistributedShampoo(model.parameters(), **CONFIG)
    _train(model, opt, 4, seed=0)
    saved = opt.state_dict()
    names = [name for name, _ in model.named_parameters()]
    by_index = dict(enumerate(names))
    named = {
        "state": {by_index[k]: v for k, v in saved["state"].items()},
        "param_groups": [{**g, "params": [by_index[i] for i in g["params"]]}
                         for g in saved["param_groups"]],
    }
    named["state"]["flag"] = 7
    reference_model = copy.deepcopy(model)
    reference = DistributedShampoo(reference_model.parameters(), **CONFIG)
    reference.load_state_dict(saved)
    loaded_model = copy.deepcopy(model)
    loaded = DistributedShampoo(loaded_model.parameters(), **CONFIG)
    loaded.load_state_dict(named)
    assert loaded.state["flag"] == 7
    for p, q in zip(reference_model.parameters(), loaded_model.parameters()):
        for key, value in reference.state[p].items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(loaded.state[q][key])), key
    _train(reference_model, reference, 4, seed=1)
    _train(loaded_model, loaded, 4, seed=1)
    for p, q in zip(reference_model.parameters(), loaded_model.parameters()):
        assert torch.equal(p, q)


def test_tool_keys_follow_the_state_dicts_numbering_with_a_repeated_tensor():
    """torch numbers a parameter by its first position, so a tensor listed twice leaves a
    gap: a tool's key under a later parameter is saved under that number and comes back
    to that parameter."""
    gen = generator(5)
    p = torch.nn.Parameter(torch.randn(4, 3, generator=gen))
    q = torch.nn.Parameter(torch.randn(5, generator=gen))
    with pytest.warns(UserWarning, match="duplicate"):
        opt = DistributedShampoo([p, p, q], **CONFIG)
    p.grad, q.grad = torch.randn(4, 3, generator=gen), torch.randn(5, generator=gen)
    opt.step()
    opt.state[q]["slow"] = torch.full((2,), 5.0)
    saved = opt.state_dict()
    assert saved["param_groups"][0]["params"] == [0, 0, 2]
    assert torch.equal(saved["state"][2]["slow"], torch.full((2,), 5.0))
    assert 1 not in saved["state"]
    with pytest.warns(UserWarning, match="duplicate"):
        other = DistributedShampoo([p, p, q], **CONFIG)
    other.load_state_dict(saved)
    assert torch.equal(other.state[q]["slow"], torch.full((2,), 5.0))
    assert "slow" not in other.state[p]
