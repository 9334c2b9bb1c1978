"""``preconditioner="sketchy"`` (docs/sketchy.md): full-rank sketches are Shampoo, its keywords'
errors, its state is O(d·k), batched stacks, checkpoints resume exactly. The comparison with
the authors' JAX reference is tests/test_sketchy_reference.py."""

from __future__ import annotations

import io

import pytest
import torch

from hf_shampoo import DistributedShampoo
from hf_shampoo.stack import ShampooNumericalError
from tests.helpers import torch_threads

pytestmark = pytest.mark.unit


def _params(shapes, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g, dtype=dtype)) for s in shapes]


def _grads(shapes, steps, dtype=torch.float32, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(s, generator=g, dtype=dtype) for s in shapes] for _ in range(steps)]


def _run(params, grads, **kwargs):
    opt = DistributedShampoo(params, distributed="none", **kwargs)
    for step in grads:
        for p, g in zip(params, step):
            p.grad = g.clone()
        opt.step()
    return opt


COMMON = dict(lr=0.1, betas=(0.9, 0.999), epsilon=1e-6, grafting="adam", momentum=0.5,
              weight_decay=0.01, max_preconditioner_dim=64, precondition_frequency=2,
              factor_matrix_dtype=torch.float64)


@pytest.mark.parametrize("threshold", [0, 15])
def test_full_rank_sketch_is_shampoo(threshold):
    """With ``k >= d`` Frequent Directions drops nothing (no escaped mass): the sketch is
    the factor itself, and with an absolute epsilon the roots are Shampoo's (float64).
    ``sketch_threshold=15`` sketches only the 20-dims (the others are Shampoo's factors).
    The factors are full rank at every refresh: on the null space of a factor Shampoo has
    ``ε^(-e)``, the reference's root 0 while no mass escaped (docs/sketchy.md)."""
    shapes = [(12, 20), (4, 6, 20)]
    grads = _grads(shapes, 6, torch.float64)
    ours = _params(shapes, torch.float64)
    shampoo = _params(shapes, torch.float64)
    opt = _run(ours, grads, preconditioner="sketchy", sketch_rank=32,
               sketch_threshold=threshold, sketch_relative_epsilon=False, **COMMON)
    _run(shampoo, grads, preconditioner="shampoo", **COMMON)
    for a, b in zip(ours, shampoo):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)
    state = opt.state_dict()["state"][0]
    sketched = {k for k in state if ".sketch_basis_" in k}
    assert sketched == ({"block_0.sketch_basis_0", "block_0.sketch_basis_1"} if threshold == 0
                        else {"block_0.sketch_basis_1"})
    assert all(float(state[k.replace("basis", "escaped_mass")]) == 0 for k in sketched)


def test_low_rank_sketch_differs_from_shampoo_and_keeps_escaped_mass():
    shapes = [(12, 40)]
    grads = _grads(shapes, 4)
    ours, shampoo = _params(shapes), _params(shapes)
    opt = _run(ours, grads, preconditioner="sketchy", sketch_rank=4, **dict(
        COMMON, factor_matrix_dtype=torch.float32))
    _run(shampoo, grads, **dict(COMMON, factor_matrix_dtype=torch.float32))
    assert not torch.allclose(ours[0], shampoo[0])
    state = opt.state_dict()["state"][0]
    assert "block_0.sketch_basis_0" in state  # 12 > sketch_threshold (None: sketch_rank)
    assert state["block_0.sketch_basis_1"].shape == (40, 4)
    assert float(state["block_0.sketch_escaped_mass_1"]) > 0
    basis = state["block_0.sketch_basis_1"]
    torch.testing.assert_close(basis.T @ basis, torch.eye(4), atol=1e-5, rtol=0)


@pytest.mark.parametrize("keywords, name", [
    (dict(sketch_rank=0), "sketch_rank"),
    (dict(sketch_rank=2.5), "sketch_rank"),
    (dict(sketch_threshold=-1), "sketch_threshold"),
    (dict(sketch_relative_epsilon="yes"), "sketch_relative_epsilon"),
    (dict(quantization="4bit"), "quantization"),
    (dict(root_inverse="coupled_newton"), "root_inverse"),
    (dict(inv_factor_matrix_dtype=torch.bfloat16), "inv_factor_matrix_dtype"),
    (dict(diagonal_aspect=4.0), "diagonal_aspect"),
    (dict(rank_deficient="pseudo_inverse", epsilon=0.0), "rank_deficient"),
    (dict(eigendecomposition="qr", sketch_threshold=0), "eigendecomposition"),
])
def test_bad_keywords_are_clear_errors(keywords, name):
    with pytest.raises(ValueError, match=name) as raised:
        DistributedShampoo(_params([(8, 8)]), preconditioner="sketchy", **keywords)
    if name == "quantization":
        assert "'shampoo'" in str(raised.value) and "'sketchy'" in str(raised.value)


def test_state_is_order_d_times_k():
    """A 512 × 256 block with rank 8 keeps 2 · (512 + 256) · 8 basis numbers (the sketch and
    the refreshed root) and a few values: no d × d tensor."""
    shapes = [(512, 256)]
    opt = _run(_params(shapes), _grads(shapes, 2), preconditioner="sketchy", sketch_rank=8,
               betas=(0.0, 1.0))
    state = opt.state_dict()["state"][0]
    assert max(t.numel() for t in state.values()) == 512 * 8
    expected = 4 * 2 * sum(d * 8 + 8 + 1 for d in (512, 256))
    assert opt.metrics()["optimizer/state_bytes"] == expected
    shampoo = _run(_params(shapes), _grads(shapes, 2), betas=(0.0, 1.0))
    assert shampoo.metrics()["optimizer/state_bytes"] > 40 * expected


@pytest.mark.parametrize("max_dim", [1024, 32])
def test_stacked_blocks_equal_separate_runs(max_dim):
    """Same-shape blocks share one stack (batched SVDs and products): each block's numbers
    are those of a run with that block alone, bit for bit (the lossless distributors give
    an owner a stack of its own blocks). ``max_dim`` 1024 merges the matrices into 600-vectors.
    At one thread, as every distributed process runs (docs/design.md §13): with two, the
    CPU's batched products of 600-vectors round by batch."""
    shapes = [(30, 20), (30, 20), (30, 20)]
    grads = _grads(shapes, 5)
    together = _params(shapes)
    settings = dict(preconditioner="sketchy", sketch_rank=6, grafting="adam", lr=0.05,
                    precondition_frequency=2, max_preconditioner_dim=max_dim)
    with torch_threads(1):
        _run(together, grads, **settings)
        for i in range(3):
            alone = _params(shapes)[i:i + 1]
            _run(alone, [[step[i]] for step in grads], **settings)
            torch.testing.assert_close(together[i], alone[0], rtol=0, atol=0)


@pytest.mark.parametrize("schedule", ["all", "staggered"])
def test_checkpoint_resumes_exactly(schedule):
    shapes = [(40, 24), (40, 24), (24,), (6, 5, 30)]
    grads = _grads(shapes, 8)
    settings = dict(preconditioner="sketchy", sketch_rank=5, sketch_threshold=8,
                    grafting="adam", lr=0.05, momentum=0.3, precondition_frequency=3,
                    betas=(0.9, 0.99), refresh_schedule=schedule, max_preconditioner_dim=40)
    straight = _params(shapes)
    _run(straight, grads, **settings)
    first = _params(shapes)
    opt = _run(first, grads[:4], **settings)
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    resumed = [torch.nn.Parameter(p.detach().clone()) for p in first]
    opt2 = DistributedShampoo(resumed, distributed="none", **settings)
    opt2.load_state_dict(saved)
    for step in grads[4:]:
        for p, g in zip(resumed, step):
            p.grad = g.clone()
        opt2.step()
    for a, b in zip(resumed, straight):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_non_finite_gradient_raises_before_any_change():
    shapes = [(20, 12)]
    params = _params(shapes)
    opt = _run(params, _grads(shapes, 1), preconditioner="sketchy", sketch_rank=4)
    before = params[0].detach().clone()
    bad = torch.full(shapes[0], float("nan"))
    params[0].grad = bad
    with pytest.raises(ShampooNumericalError, match="non-finite"):
        opt.step()
    assert torch.equal(params[0], before)
