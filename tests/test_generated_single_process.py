"""The drawn layout cases' one-process runs, on the test device (``HF_SHAMPOO_TEST_DEVICE``).

``tests/test_generated_layouts.py`` compares every drawn DTensor layout with one process on
gloo ranks, which run on the CPU. This module takes the same draws (tests/layout_cases.py:
kind, block size, cadence, start step, decay, shapes, steps without gradients, the steps
of a mid-run save) and runs their one-process part where the device tests run, so that on
a GPU every drawn configuration also trains there. For each case, on that device:

- two runs give the same bits (no nondeterministic kernel on the step's path);
- every state tensor lives on the parameters' device;
- a run saved by ``state_dict()`` at the case's save step (or half way), loaded into a fresh
  optimizer over fresh parameters and continued, ends bit-identical to the run never
  interrupted.

(CUDA's numbers are not compared with the CPU's here: a drawn case may precondition with
rank-deficient factors, where any round-off is magnified; tests/test_gpu.py compares the two
on well-posed runs.)
"""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn

from tests import distributed_worker as ddp_worker
from tests import layout_cases as lc
from tests.helpers import TEST_DEVICE

pytestmark = [pytest.mark.unit, pytest.mark.device]

#: synthetic cases drawn per seed (2-rank draws: the shapes and settings are the point)
CASES = 12


def _cases() -> list[dict]:
    out = []
    for k, seed in enumerate(lc.seeds()):
        index = 0
        while len(out) < CASES * (k + 1):
            case = lc.draw_dtensor_case(seed * 1_000_003 + 7_000 + index, 2)
            index += 1
            if "shapes" in case:  # synthetic, not a model or pipeline case
                out.append(case | {"base_seed": seed})
    return out


def _optimizer(params, case):
    from hf_shampoo import DistributedShampoo
    return DistributedShampoo(lc.param_groups(params, case["names"], case["config"]),
                              **lc.optimizer_kwargs(case["config"]), distributed="none")


def _train(case, params, opt, first: int, last: int) -> None:
    config = case["config"]
    for step in range(first, last + 1):
        grads = lc.full_grads(case["shapes"], case["seed"], step, case["no_grad"])
        for p, grad in zip(params, grads):
            p.grad = None if grad is None else grad.to(TEST_DEVICE)
        ddp_worker.before_step(opt, config)
        opt.step()
        ddp_worker.after_step(opt, config, step)


def _fresh(case):
    initial = lc.full_params(case["shapes"], case["seed"])
    return [nn.Parameter(t.to(TEST_DEVICE)) for t in initial]


def _run(case, stop_at: int | None = None):
    params = _fresh(case)
    opt = _optimizer(params, case)
    _train(case, params, opt, 1, case["steps"] if stop_at is None else stop_at)
    return params, opt


CASE_LIST = _cases()


@pytest.mark.parametrize("case", CASE_LIST,
                         ids=[f"seed{c['base_seed']}-{c['kind']}-{i}"
                              for i, c in enumerate(CASE_LIST)])
def test_drawn_case_is_deterministic_and_resumes_exactly(case):
    params, opt = _run(case)
    again, _ = _run(case)
    for name, a, b in zip(case["names"], params, again):
        assert torch.equal(a, b), f"{name} differs between two runs\n{lc.describe(case)}"
    devices = {t.device for entry in opt.state_dict()["state"].values()
               for t in entry.values() if torch.is_tensor(t) and t.dim() > 0}
    assert devices <= {params[0].device}, devices

    save_at = case.get("resume_at", max(1, case["steps"] // 2))
    half, half_opt = _run(case, stop_at=save_at)
    buffer = io.BytesIO()
    torch.save({"params": [p.detach().cpu() for p in half],
                "optimizer": half_opt.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    resumed = [nn.Parameter(t.to(TEST_DEVICE)) for t in saved["params"]]
    opt2 = _optimizer(resumed, case)
    opt2.load_state_dict(saved["optimizer"])
    _train(case, resumed, opt2, save_at + 1, case["steps"])
    for name, a, b in zip(case["names"], resumed, params):
        assert torch.equal(a, b), (f"{name}: resumed at step {save_at} differs by "
                                   f"{(a - b).abs().max().item():.3g}\n{lc.describe(case)}")
