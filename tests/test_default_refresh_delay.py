"""The default ``refresh_delay`` of ``make_optimizer``, the Trainer and timm
(``config.adamw_style_refresh_delay``; docs/performance.md#refresh_delay).

What a user relies on: the three entry points give each refresh one step off the critical
path (``refresh_delay=1``) unless they name a delay; a group where a delay is refused (4-bit
state, ``apply_precision="tf32"``) gets 0 instead of an error, also when only an override
pattern makes it so; Meta's defaults and the plain class keep 0; and a default run is the
explicit ``refresh_delay=1`` run, bit for bit. Resuming a checkpoint saved with another
delay is tested in tests/test_refresh_delay.py.
"""

from __future__ import annotations

import pytest
import torch
from timm.optim import create_optimizer_v2

from hf_shampoo import DistributedShampoo, make_optimizer
from hf_shampoo.integrations.timm import register
from hf_shampoo.integrations.transformers import create_optimizer
from tests.tiny_trainer import tiny_gpt2, training_args

pytestmark = pytest.mark.integrations

ATTENTION = "*.attn.c_attn.weight"


def delays(optimizer) -> dict[str, int]:
    """Parameter name → its group's ``refresh_delay``."""
    return {name: group["refresh_delay"] for group in optimizer.param_groups
            for name in group["param_names"]}


def test_the_plain_class_keeps_metas_zero():
    assert DistributedShampoo([torch.nn.Parameter(torch.ones(3, 2))]).defaults[
        "refresh_delay"] == 0


def test_make_optimizer_delays_each_refresh_by_one_step():
    model = tiny_gpt2()
    assert set(delays(make_optimizer(model)).values()) == {1}
    assert set(delays(make_optimizer(model, refresh_delay=0)).values()) == {0}
    assert set(delays(make_optimizer(model, defaults="meta")).values()) == {0}
    assert set(delays(make_optimizer(model, memory="sketch")).values()) == {1}


@pytest.mark.parametrize("refusing", [{"quantization": "4bit"}, {"apply_precision": "tf32"}])
def test_make_optimizer_gives_zero_where_a_delay_is_refused(refusing):
    model = tiny_gpt2()
    assert set(delays(make_optimizer(model, **refusing)).values()) == {0}
    one_pattern = delays(make_optimizer(model, overrides={ATTENTION: refusing}))
    assert one_pattern["transformer.h.0.attn.c_attn.weight"] == 0
    assert {d for n, d in one_pattern.items() if "c_attn" not in n} == {1}
    # a delay the user names is theirs: the refusal names it
    with pytest.raises(ValueError, match="refresh_delay"):
        make_optimizer(model, refresh_delay=1, quantization="4bit")


def test_the_trainer_delays_each_refresh_by_one_step(tmp_path):
    model = tiny_gpt2()
    built = create_optimizer(model, training_args(tmp_path, optim="distributed_shampoo"))
    assert set(delays(built).values()) == {1}
    for optim_args, expected in (("refresh_delay=0", {0}), ("quantization=4bit", {0})):
        args = training_args(tmp_path, optim="distributed_shampoo", optim_args=optim_args)
        assert set(delays(create_optimizer(model, args)).values()) == expected, optim_args
    args = training_args(tmp_path, optim="distributed_shampoo",
                         optim_args=f"{ATTENTION}@quantization=4bit")
    one_pattern = delays(create_optimizer(model, args))
    assert one_pattern["transformer.h.0.attn.c_attn.weight"] == 0
    assert {d for n, d in one_pattern.items() if "c_attn" not in n} == {1}


@pytest.mark.parametrize("name", ["shampoo", "soap"])
def test_timm_delays_each_refresh_by_one_step(name):
    register()
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))
    assert {g["refresh_delay"] for g in create_optimizer_v2(model, name).param_groups} == {1}
    explicit = create_optimizer_v2(model, name, refresh_delay=0)
    assert {g["refresh_delay"] for g in explicit.param_groups} == {0}


def test_the_default_is_the_explicit_delay_bit_for_bit():
    """``make_optimizer(model)`` trains as ``make_optimizer(model, refresh_delay=1)`` and
    not as ``refresh_delay=0`` (the delay is in effect, not only in the groups)."""
    def run(**kw) -> list[torch.Tensor]:
        model = tiny_gpt2()
        opt = make_optimizer(model, lr=1e-2, precondition_frequency=2,
                             start_preconditioning_step=2, **kw)
        ids = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(3))
        for _ in range(6):
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
        return [p.detach().clone() for p in model.parameters()]

    default, one, zero = run(), run(refresh_delay=1), run(refresh_delay=0)
    assert all(torch.equal(a, b) for a, b in zip(default, one))
    assert not all(torch.equal(a, b) for a, b in zip(default, zero))
