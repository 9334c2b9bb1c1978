"""``preconditioner="sketchy"`` against the authors' JAX reference,
``precondition.tearfree.sketchy`` (google-research/precondition, Apache-2.0), on fixed
gradients over several steps and shapes: the sketch (as the implied low-rank matrix
``U diag(σ²) Uᵀ``, free of the basis' rotation within eigenspaces), the escaped mass, the
low-rank inverse root and the preconditioned direction agree to float32 rounding
(docs/design.md §3, docs/sketchy.md). Needs ``jax`` and the reference's checkout; skipped
otherwise."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from hf_shampoo import DistributedShampoo

REFERENCE = Path(os.environ.get("HF_SHAMPOO_PRECONDITION_REFERENCE",
                                "/work/shared/google-precondition-239a8cd"))

jax = pytest.importorskip("jax", reason="the JAX reference needs jax (pip install jax optax "
                          "chex absl-py)")
if not (REFERENCE / "precondition" / "tearfree" / "sketchy.py").exists():
    pytest.skip(f"the reference checkout {REFERENCE} (google-research/precondition) is "
                "missing: set HF_SHAMPOO_PRECONDITION_REFERENCE", allow_module_level=True)
sys.path.insert(0, str(REFERENCE))
try:
    from precondition.tearfree import sketchy as reference  # noqa: E402
except ImportError as error:  # the reference also imports optax, chex and absl
    pytest.skip(f"the JAX reference cannot be imported ({error}): pip install jax optax chex "
                "absl-py", allow_module_level=True)
finally:
    sys.path.remove(str(REFERENCE))

pytestmark = pytest.mark.reference

STEPS = 6
# (shape, rank, beta2, relative epsilon, epsilon)
CASES = [
    ((16, 48), 4, 1.0, True, 1e-7),
    ((32, 24), 8, 1.0, False, 1e-4),
    ((64,), 4, 1.0, True, 1e-7),
    ((8, 16, 12), 4, 1.0, True, 1e-7),
    ((40, 20), 6, 0.99, True, 1e-7),
]


def _gradients(shape, seed):
    """Gradients with a decaying spectrum along every dim (distinct singular values)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(STEPS):
        x = torch.randn(shape, generator=g)
        for j, d in enumerate(shape):
            scale = torch.logspace(0, -1.5, d)
            view = [1] * len(shape)
            view[j] = d
            x = x * scale.view(view)
        out.append(x)
    return out


def _run_reference(grads, rank, beta2, relative, epsilon):
    options = reference.Options(epsilon=epsilon, rank=rank, relative_epsilon=relative,
                                second_moment_decay=beta2, update_freq=1)
    transform = reference.apply(options)
    update = jax.jit(transform.update)
    params = {"w": jax.numpy.zeros(grads[0].shape, dtype=jax.numpy.float32)}
    state = transform.init(params)
    results = []
    for g in grads:
        updates, state = update({"w": jax.numpy.asarray(g.numpy())}, state, params)
        axes = state.sketches["w"].axes
        results.append((np.asarray(updates["w"]),
                        [dict(eigvecs=np.asarray(a.eigvecs), eigvals=np.asarray(a.eigvals),
                              inv_eigvals=np.asarray(a.inv_eigvals),
                              tail=float(a.tail), inv_tail=float(a.inv_tail)) for a in axes]))
    return results


def _run_ours(grads, rank, beta2, relative, epsilon):
    shape = grads[0].shape
    w = torch.nn.Parameter(torch.zeros(shape))
    opt = DistributedShampoo(
        [w], lr=1.0, betas=(0.0, beta2), epsilon=epsilon, use_bias_correction=False,
        preconditioner="sketchy", sketch_rank=rank, sketch_threshold=0,
        sketch_relative_epsilon=relative, max_preconditioner_dim=max(shape),
        precondition_frequency=1, start_preconditioning_step=1, distributed="none")
    results = []
    for g in grads:
        with torch.no_grad():
            w.zero_()
        w.grad = g.clone()
        opt.step()
        direction = -w.detach().clone()  # W = 0 - 1.0 * P, exactly
        state = opt.state_dict()["state"][0]
        axes = []
        for j in range(len(shape)):
            axes.append({name: state[f"block_0.sketch_{name}_{j}"].double().numpy()
                         for name in ("basis", "values", "escaped_mass", "root_basis",
                                      "root_values", "root_tail")})
        results.append((direction.double().numpy(), axes))
    return results


def _low_rank(vectors, values):
    v = vectors.astype(np.float64)
    return (v * values.astype(np.float64)) @ v.T


def _relative(a, b):
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


@pytest.mark.parametrize("shape, rank, beta2, relative, epsilon", CASES)
def test_sketchy_matches_the_jax_reference(shape, rank, beta2, relative, epsilon):
    grads = _gradients(shape, seed=sum(shape) + rank)
    ours = _run_ours(grads, rank, beta2, relative, epsilon)
    theirs = _run_reference(grads, rank, beta2, relative, epsilon)
    # ours weighs each gradient by w = 1 - β2 (Meta's convention), the reference by 1: every
    # second moment is w times the reference's, so with a relative epsilon the direction is
    # the reference's times w^(-Σ e_j) = w^(-1/2)
    w = 1.0 if beta2 == 1.0 else 1.0 - beta2
    worst = {}
    for (p, axes), (p_ref, axes_ref) in zip(ours, theirs):
        for a, r in zip(axes, axes_ref):
            sketch = _low_rank(a["basis"], a["values"] ** 2) / w
            sketch_ref = _low_rank(r["eigvecs"], r["eigvals"] ** 2)
            worst["sketch"] = max(worst.get("sketch", 0.0), _relative(sketch, sketch_ref))
            mass, mass_ref = float(a["escaped_mass"]) / w, r["tail"]
            scale = max(abs(mass_ref), 1e-6 * np.abs(sketch_ref).max())
            worst["escaped_mass"] = max(worst.get("escaped_mass", 0.0),
                                        abs(mass - mass_ref) / scale)
            e = 1.0 / (2 * len(shape))
            root = _low_rank(a["root_basis"], a["root_values"]) * w**e
            root_ref = _low_rank(r["eigvecs"], r["inv_eigvals"])
            worst["root"] = max(worst.get("root", 0.0), _relative(root, root_ref))
            tail, tail_ref = float(a["root_tail"]) * w**e, r["inv_tail"]
            worst["root_tail"] = max(worst.get("root_tail", 0.0),
                                     abs(tail - tail_ref) / max(abs(tail_ref), 1e-30))
        worst["direction"] = max(worst.get("direction", 0.0),
                                 _relative(p * w**0.5, p_ref.astype(np.float64)))
    print(f"\n{shape} rank {rank} beta2 {beta2}: largest relative differences {worst}")
    # float32 rounding, compounded over the steps' SVDs and inverse roots
    assert worst["sketch"] < 1e-5, worst
    assert worst["escaped_mass"] < 1e-4, worst
    assert worst["root"] < 1e-4, worst
    assert worst["root_tail"] < 1e-4, worst
    assert worst["direction"] < 1e-4, worst
