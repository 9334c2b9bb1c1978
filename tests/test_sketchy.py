"""``preconditioner="sketchy"`` (docs/sketchy.md): full-rank sketches are Shampoo, its keywords'
errors, its state is O(d·k), batched stacks, checkpoints resume exactly. The comparison with
the authors' JAX reference is tests/test_sketchy_reference.py."""

from __future__ import annotations

import io
import warnings

import pytest
import torch

from hf_shampoo import DistributedShampoo
from hf_shampoo.errors import ShampooNumericalError
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
    (dict(root_inverse="coupled_newton"), "root_inverse"),
    (dict(inv_factor_matrix_dtype=torch.bfloat16), "inv_factor_matrix_dtype"),
    (dict(diagonal_aspect=4.0), "diagonal_aspect"),
    (dict(rank_deficient="pseudo_inverse", epsilon=0.0), "rank_deficient"),
    (dict(eigendecomposition="qr", sketch_threshold=0), "eigendecomposition"),
    (dict(statistics_frequency=3, precondition_frequency=4), "statistics_frequency"),
    (dict(statistics_warmup=2), "statistics_warmup"),
])
def test_bad_keywords_are_clear_errors(keywords, name):
    with pytest.raises(ValueError, match=name):
        DistributedShampoo(_params([(8, 8)]), preconditioner="sketchy", **keywords)


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


@pytest.mark.parametrize("max_dim,batch_variant", [(1024, False), (32, False), (32, True)],
                         ids=["1024-library", "32-library", "32-batch_variant"])
def test_stacked_blocks_equal_separate_runs(monkeypatch, max_dim, batch_variant):
    """Same-shape blocks in one stack (batched SVDs and products): each block's numbers are
    those of a run with that block alone, to float32 round-off, with the library at hand
    and with products that round by batch (``tests/batch_variant.py``): no row reads
    another. ``max_dim`` 1024 merges the matrices into 600-vectors, whose rank-6 sketches
    leave a null space whose directions round-off decides (0.5 apart under the swapped
    products: ill-posed for a tolerance). Bit for bit is the business of the stacking
    rule, which gives every layout the same stacks (docs/design.md §4)."""
    from contextlib import nullcontext

    from hf_shampoo import stacking
    from tests.batch_variant import BatchVariantProducts

    monkeypatch.setattr(stacking, "MIN_STACKS", 1)  # the three blocks in one stack
    shapes = [(30, 20), (30, 20), (30, 20)]
    grads = _grads(shapes, 5)
    together = _params(shapes)
    settings = dict(preconditioner="sketchy", sketch_rank=6, grafting="adam", lr=0.05,
                    precondition_frequency=2, max_preconditioner_dim=max_dim)
    with torch_threads(1), BatchVariantProducts() if batch_variant else nullcontext():
        opt = _run(together, grads, **settings)
        assert [len(s.members) for s in opt._ensure_layout().stacks] == [3]
        for i in range(3):
            alone = _params(shapes)[i:i + 1]
            _run(alone, [[step[i]] for step in grads], **settings)
            torch.testing.assert_close(together[i], alone[0], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("schedule,every,bits", [("all", None, None),
                                                 ("staggered", None, None),
                                                 ("staggered", 3, None), ("all", None, "4bit")])
def test_checkpoint_resumes_exactly(schedule, every, bits):
    shapes = [(40, 24), (40, 24), (24,), (6, 5, 30)]
    grads = _grads(shapes, 8)
    settings = dict(preconditioner="sketchy", sketch_rank=5, sketch_threshold=8,
                    grafting="adam", lr=0.05, momentum=0.3, precondition_frequency=3,
                    betas=(0.9, 0.99), refresh_schedule=schedule, max_preconditioner_dim=40,
                    statistics_frequency=every, quantization=bits)
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


def _sketch_state(opt, index):
    return {k: v.clone() for k, v in opt.state_dict()["state"][index].items()
            if ".sketch_basis_" in k or ".sketch_values_" in k or ".sketch_escaped_mass_" in k}


def test_failed_svd_keeps_the_previous_sketch(monkeypatch):
    """Where LAPACK raises in the batched SVD, each matrix is decomposed on its own; one
    that fails there (and in float64) keeps its previous sketch, with a warning naming the
    parameter and a count in ``metrics()``, while its stack-mates get the numbers of a run
    without failures; after too many failures in a row the step raises."""
    import hf_shampoo.linalg as linalg
    from hf_shampoo import stacking

    monkeypatch.setattr(stacking, "MIN_STACKS", 1)  # the three blocks in one stack
    shapes = [(30, 20)] * 3
    grads = _grads(shapes, 8)
    settings = dict(preconditioner="sketchy", sketch_rank=6, grafting="adam", lr=0.05,
                    precondition_frequency=2, betas=(0.9, 0.99), max_preconditioner_dim=32)
    with torch_threads(1):
        reference = _params(shapes)
        ref_opt = _run(reference, grads[:3], **settings)
        failing = _params(shapes)
        opt = _run(failing, grads[:2], **settings)
        before = _sketch_state(opt, 1)
        calls = {"n": 0}
        real_one = linalg._svd_one

        def batched_raises(*args):
            raise torch.linalg.LinAlgError("injected: SVD did not converge")

        def row_one_fails(matrix):  # called row by row: 0, 1, 2 per sketched dim
            calls["n"] += 1
            return None if calls["n"] % 3 == 2 else real_one(matrix)

        monkeypatch.setattr(linalg, "_svd_into", batched_raises)
        monkeypatch.setattr(linalg, "_svd_one", row_one_fails)
        opt.metrics()  # reading starts the count of fallbacks from 0
        for p, g in zip(failing, grads[2]):
            p.grad = g.clone()
        with pytest.warns(UserWarning, match=r"Frequent-Directions SVD of sketch_basis_\d"):
            opt.step()
        assert calls["n"] == 6  # two sketched dims, three rows each
        assert opt.metrics()["optimizer/fallbacks"] == 2
        after = _sketch_state(opt, 1)
        assert before.keys() == after.keys() and len(after) == 6
        for name in before:
            assert torch.equal(before[name], after[name]), name
        for i in (0, 2):  # the other rows: as without any failure
            torch.testing.assert_close(failing[i], reference[i], rtol=0, atol=0)
            ours, theirs = _sketch_state(opt, i), _sketch_state(ref_opt, i)
            for name in ours:
                torch.testing.assert_close(ours[name], theirs[name], rtol=0, atol=0)
        with pytest.warns(UserWarning):  # failures 2 and 3 in a row: still warnings
            for step in grads[3:5]:
                for p, g in zip(failing, step):
                    p.grad = g.clone()
                opt.step()
        for p, g in zip(failing, grads[5]):
            p.grad = g.clone()
        with pytest.raises(ShampooNumericalError, match="4th time in a row; giving up"):
            opt.step()


def test_svd_retried_in_float64_where_float32_fails(monkeypatch):
    """A float32 SVD that raises is taken again in float64: every block goes on, close to
    the run where float32 succeeded, with no fallback."""
    import hf_shampoo.linalg as linalg

    real_svd = torch.linalg.svd

    def float32_raises(matrix, *args, **kwargs):
        if matrix.dtype == torch.float32:
            raise torch.linalg.LinAlgError("injected: float32 SVD did not converge")
        return real_svd(matrix, *args, **kwargs)

    shapes = [(30, 20)] * 2
    grads = _grads(shapes, 4)
    settings = dict(preconditioner="sketchy", sketch_rank=6, grafting="adam", lr=0.05,
                    precondition_frequency=2, max_preconditioner_dim=32)
    reference = _params(shapes)
    _run(reference, grads, **settings)
    retried = _params(shapes)
    monkeypatch.setattr(linalg.torch.linalg, "svd", float32_raises)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt = _run(retried, grads, **settings)
    assert opt.metrics()["optimizer/fallbacks"] == 0
    for a, b in zip(retried, reference):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
        assert not torch.equal(a, b)  # float64 ran


@pytest.mark.parametrize("schedule", ["all", "staggered"])
def test_statistics_frequency_samples_the_sketches(schedule):
    """``statistics_frequency=s`` (the reference's ``update_freq``): a block's sketches take
    the gradients of its own steps that are multiples of ``s`` (and of its refreshes) only.
    With ``β2 = 1`` a zero gradient leaves a sketch as it is, so the sketches equal those of
    a run that takes every step's gradient but sees zeros at the skipped steps (each block
    by its own schedule, whose offsets both runs share)."""
    shapes = [(24, 16), (24, 16), (6, 5, 30)]
    steps = 12
    grads = _grads(shapes, steps, torch.float64)
    settings = dict(preconditioner="sketchy", sketch_rank=4, grafting="adam", lr=0.05,
                    betas=(0.9, 1.0), precondition_frequency=4, max_preconditioner_dim=30,
                    refresh_schedule=schedule, factor_matrix_dtype=torch.float64)
    sampled = _params(shapes, torch.float64)
    opt = _run(sampled, grads, statistics_frequency=2, **settings)
    offsets = {}
    for row in opt.describe_blocks():
        offsets[(row["param_index"], row["block"])] = row["refresh_offset"]
    assert schedule == "all" or any(offsets.values()), offsets
    # every block is one whole parameter here: zero each parameter's skipped gradients
    masked = [[g if (t - offsets[(i, 0)]) % 2 == 0 else torch.zeros_like(g)
               for i, g in enumerate(step)]
              for t, step in enumerate(grads, start=1)]
    every = _params(shapes, torch.float64)
    reference = _run(every, masked, **settings)
    for i in range(len(shapes)):
        ours, theirs = _sketch_state(opt, i), _sketch_state(reference, i)
        assert ours
        for name in ours:
            torch.testing.assert_close(ours[name].abs(), theirs[name].abs(), rtol=1e-9,
                                       atol=1e-9)
    # the sketches did skip gradients: they differ from a run that takes all of them
    full = _run(_params(shapes, torch.float64), grads, **settings)
    name = "block_0.sketch_values_0"
    assert not torch.allclose(_sketch_state(opt, 0)[name], _sketch_state(full, 0)[name])


def test_4bit_bases_are_the_sketches_stored_in_4_bits(monkeypatch):
    """``quantization="4bit"``: the sketches' and roots' bases are kept as 4-bit codes and
    scales of their directions (the values, escaped mass and full dims' factors float32),
    and the run is the 32-bit algorithm whose every new basis goes through 4-bit storage
    (quantised, dequantised, one Björck step: benchmarks/sketch_4bit_probe.py), to float32
    rounding; the bases' bytes are about 7 times fewer."""
    from benchmarks.sketch_4bit_probe import quantized_frequent_directions
    from hf_shampoo.preconditioners import sketchy

    shapes = [(40, 24), (40, 24), (24,), (6, 5, 30)]
    grads = _grads(shapes, 8)
    settings = dict(preconditioner="sketchy", sketch_rank=5, sketch_threshold=8,
                    grafting="adam", lr=0.05, precondition_frequency=3, betas=(0.9, 0.99),
                    max_preconditioner_dim=40, epsilon=1e-7)
    four = _params(shapes)
    opt = _run(four, grads, quantization="4bit", **settings)
    state = opt.state_dict()["state"][0]
    assert state["block_0.sketch_basis_0_codes"].dtype == torch.uint8
    assert state["block_0.sketch_basis_0_codes"].shape == (5, 32)  # 5 directions of 40
    assert state["block_0.sketch_values_0"].dtype == torch.float32
    monkeypatch.setattr(sketchy, "frequent_directions", quantized_frequent_directions)
    simulated = _params(shapes)
    _run(simulated, grads, **settings)
    monkeypatch.undo()
    exact = _params(shapes)
    thirty_two = _run(exact, grads, **settings)
    for a, b, c in zip(four, simulated, exact):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        assert not torch.allclose(a, c, rtol=1e-5, atol=1e-6)  # 4 bits did change it
    small = opt.metrics()["optimizer/state_bytes"]
    assert small < thirty_two.metrics()["optimizer/state_bytes"]
