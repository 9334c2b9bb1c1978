"""Sketchy: Shampoo with Frequent-Directions sketches of the large factors (arXiv 2302.03764;
docs/design.md §3, docs/sketchy.md).

Each preconditioned dim of a block larger than ``sketch_threshold`` (default: ``sketch_rank``)
keeps, instead of the ``d × d`` factor ``F_j``, a rank-``k`` Frequent-Directions sketch
(``k = min(sketch_rank, d)``): a ``d × k`` orthonormal basis ``U``, the sketch's ``k``
singular values ``σ`` (``B = U diag(σ)``, ``B Bᵀ ≈ F_j``) and the escaped mass ``ρ`` (the
eigenvalue mass the sketch dropped). Smaller dims keep Shampoo's full factors and roots.

Every step, per sketched dim (``X = G_(j)``, the gradient unfolded along ``j``, ``d × m``)::

    [U σ √β2 , √w X] = U' S V'ᵀ        (thin SVD, d × (k + m); w = 1 if β2 == 1 else 1 − β2)
    c = S[k] (0 if there is none)       σ' = √(S[:k]² − c²)        ρ' = √β2 ρ + c²
    U' ← U'[:, :k] with columns of σ' = 0 zeroed

the update of precondition's ``tearfree/sketchy.py`` (its ``_update_axis``, with its escaped mass
decayed by ``√β2``), up to our ``w`` weighting and bias correction. At refresh steps the
low-rank inverse root is taken from the sketch: ``λ = (σ'² + ρ') / bc2`` on the basis,
``ρ' / bc2`` on its orthogonal complement, ``ε`` added to both (``sketch_relative_epsilon``:
``ε · max λ``, the reference's default), ``λ^(-e_j)`` where ``σ' > 0`` (else 0) and
``(ρ'/bc2 + ε)^(-e_j)`` where ``ρ' > 0`` (else 0). ``P`` applies, along dim ``j``,
``U diag(λ^(-e)) Uᵀ + τ (I − U Uᵀ)`` (never a ``d × d`` matrix), then the full dims' roots.

State per sketched dim ``j``: ``sketch_basis_{j}`` (d, k), ``sketch_values_{j}`` (k,),
``sketch_escaped_mass_{j}`` (), and the refreshed root ``sketch_root_basis_{j}`` (d, k),
``sketch_root_values_{j}`` (k,), ``sketch_root_tail_{j}`` () (basis 0 and tail 1: the
identity before the first refresh).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .. import linalg, quantization
from ..keywords import Keyword, boolean, fail, integer
from ..kronecker import _bmm, unfold
from ..update_rules import Scratch, second_moment_bias
from .shampoo import Shampoo

SKETCHY_KEYWORDS = (
    Keyword("sketch_rank", 128, int, integer(1), scope=frozenset({"layout"}), doc=(
            "`preconditioner=\"sketchy\"`: rank `k` of the Frequent-Directions sketch kept "
            "for each large block dim (`min(k, d)` columns; see [Sketchy](sketchy.md))")),
    Keyword("sketch_threshold", None, int, integer(0), scope=frozenset({"layout"}), doc=(
            "`preconditioner=\"sketchy\"`: block dims larger than this keep a sketch, the "
            "others Shampoo's full factor (`None` → `sketch_rank`; `0` sketches every dim)")),
    Keyword("sketch_relative_epsilon", True, bool, boolean(), doc=(
            "`preconditioner=\"sketchy\"`: `epsilon` is relative to each sketch's largest "
            "eigenvalue (`ε · λ_max`, the reference's default); `False`: absolute, as "
            "Shampoo's")),
)


class Sketchy(Shampoo):
    name = "sketchy"
    keywords = SKETCHY_KEYWORDS
    # the full dims are Shampoo's, without the options that need every dim to be a full root
    root_dtype = coupled_roots = diagonal_factors = inverse_roots = False
    # (quantizable: with quantization="4bit" the sketches' and the roots' bases are kept in
    # 4 bits, as 4-bit Shampoo's eigenvectors, one Björck step on loading; the rest float32)
    sketches = "shampoo"  # make_optimizer(memory="sketch") turns Shampoo's groups into these
    samples_statistics = True  # statistics_frequency: the reference's update_freq

    # ------------------------------------------------------------------ which dims
    @staticmethod
    def rank(group: dict, d: int) -> int:
        return min(int(group["sketch_rank"]), d)

    def sketched_dims(self, shape: tuple[int, ...], group: dict) -> list[int]:
        """Preconditioned dims larger than ``sketch_threshold`` (default ``sketch_rank``)."""
        threshold = group["sketch_threshold"]
        threshold = group["sketch_rank"] if threshold is None else threshold
        return [j for j in self.preconditioned_dims(group, len(shape)) if shape[j] > threshold]

    def factor_dims(self, stack, group: dict) -> list[int]:
        """The full (Shampoo) dims: preconditioned and not sketched."""
        sketched = self.sketched_dims(stack.shape, group)
        return [j for j in self.preconditioned_dims(group, stack.order) if j not in sketched]

    def check(self, group: dict) -> None:
        super().check(group)
        if group["statistics_warmup"] is not None:
            fail("statistics_warmup", group["statistics_warmup"], "it sets the warm-up of "
                 "4-bit factors; a sketch takes every gradient unless statistics_frequency "
                 "says otherwise: expected None with preconditioner='sketchy'")
        if group["eigendecomposition"] == "qr" and group["sketch_threshold"] == 0:
            fail("eigendecomposition", "qr", "with sketch_threshold=0 every dim is sketched "
                 "and there is no factor to refresh by QR: expected 'eigh'")

    def step_flops(self, shape: tuple[int, ...], group: dict) -> float:
        """Shampoo's cost for the full dims; per sketched dim a thin SVD of ``d × (k + m)``
        (about ``10 d (k + m) min(d, k + m)``) and two products with the basis."""
        numel = math.prod(shape)
        sketched = self.sketched_dims(shape, group)
        flops = 10.0 * numel
        frequency = max(int(group.get("precondition_frequency", 1) or 1), 1)
        for j in self.preconditioned_dims(group, len(shape)):
            d = shape[j]
            if j in sketched:
                k, m = self.rank(group, d), numel // d
                every = group.get("statistics_frequency") or 1
                flops += 4.0 * k * numel + 10.0 * d * (k + m) * min(d, k + m) / every
            else:
                flops += 4.0 * d * numel + 10.0 * d**3 / frequency
        return flops

    # ------------------------------------------------------------------ state
    def state_shapes(self, stack, group: dict) -> dict:
        shapes = super().state_shapes(stack, group)
        dtype = group["factor_matrix_dtype"]
        quantized = group["quantization"] == "4bit"
        for j in self.sketched_dims(stack.shape, group):
            d = stack.shape[j]
            k = self.rank(group, d)
            for prefix, rest in (("sketch", "escaped_mass"), ("sketch_root", "tail")):
                name = f"{prefix}_basis_{j}"
                if quantized:  # the k directions as rows of d, in 4 bits
                    shapes.update(quantization.state_shapes(name, k, d))
                else:
                    shapes[name] = ((d, k), dtype)
                shapes[f"{prefix}_values_{j}"] = ((k,), dtype)
                shapes[f"{prefix}_{rest}_{j}"] = ((), dtype)
        return shapes

    def initial_state(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, n: int,
                      device: torch.device) -> Tensor:
        if name.startswith("sketch_root_tail_"):  # identity before the first refresh
            return torch.ones((n, *shape), dtype=dtype, device=device)
        return super().initial_state(name, shape, dtype, n, device)

    # ------------------------------------------------------------------ statistics
    def _sketches(self, stack, job, g: Tensor, rows: list[int] | None,
                  count: bool) -> dict[str, Tensor]:
        """The Frequent-Directions update of every sketched dim, out of place (``rows``: of
        the state and of ``g``; None: all). ``count``: these results are adopted, so rows
        whose SVD failed (and keep their previous sketch) are warned about and counted as
        Shampoo's failed eigendecompositions are (``ShampooNumericalError`` after too many
        in a row)."""
        group, state = job.group, job.state
        beta2 = group["betas"][1]
        out = {}
        for j in self.sketched_dims(stack.shape, group):
            names = (f"sketch_basis_{j}", f"sketch_values_{j}", f"sketch_escaped_mass_{j}")
            basis = load_basis(state, names[0], stack.shape[j], rows)
            values, mass = (state[n] if rows is None else state[n][rows] for n in names[1:])
            x = unfold(g if rows is None else g[rows], j)
            basis, values, mass, ok = frequent_directions(basis, values, mass, x, beta2)
            out.update(zip(names, (basis, values, mass)))
            name = f"sketch_basis_{j}"
            # (only after a failure: a steady step reads nothing on the host)
            if count and (not all(ok) or any(stack.failures.get(name, ()))):
                flags = torch.tensor(ok, device="cpu")  # bookkeeping: on the CPU
                members = [job.members[r] for r in (range(len(ok)) if rows is None else rows)]
                stack.count_failures(name, flags, members, job.step,
                                     what="Frequent-Directions SVD")
        return out

    @staticmethod
    def sample_rows(job) -> list[int] | None:
        """Rows whose sketches take this step's gradient (None: all): with
        ``statistics_frequency = s``, those whose own step (the step minus the row's refresh
        offset) is a multiple of ``s``, and those refreshing (whose roots are taken from the
        sketch this step, whichever process or stack computes them)."""
        every = job.group["statistics_frequency"]
        if every is None or every == 1:
            return None
        refresh = set(job.refresh_rows)
        return [r for r in range(job.grad.shape[0])
                if job.own_step(r) % every == 0 or r in refresh]

    def checked_factors(self, stack, job) -> dict[str, Tensor]:
        """Shampoo's full factors and the updated sketches of the refreshing rows, out of
        place: checked for non-finite values before anything changes, adopted by
        ``update_statistics`` when every row refreshes."""
        factors = super().checked_factors(stack, job)
        rows = job.refresh_rows
        everything = len(rows) == job.grad.shape[0]
        g = job.grad.to(job.group["factor_matrix_dtype"])
        factors.update(self._sketches(stack, job, g, None if everything else rows,
                                      count=everything))
        return factors

    def update_statistics(self, stack, job, g: Tensor, scratch: Scratch) -> None:
        state = job.state
        if job.new_factors is not None:  # computed and checked already: adopt, in place
            for name, value in job.new_factors.items():
                put(state, name, value)
            return
        super().update_statistics(stack, job, g, scratch)
        rows = self.sample_rows(job)
        if rows == []:
            return
        index = None if rows is None else torch.tensor(rows, device=g.device)
        for name, value in self._sketches(stack, job, g, rows, count=True).items():
            put(state, name, value, index)

    # ------------------------------------------------------------------ refresh
    def refresh(self, stack, job, rows: list[int], first: bool, workspace) -> None:
        """Shampoo's roots for the full dims; for each sketched dim the low-rank root of
        the current sketch (no decomposition: the sketch is one)."""
        super().refresh(stack, job, rows, first, workspace)
        group, state = job.group, job.state
        everything = rows == list(range(job.grad.shape[0]))
        index = None if everything else torch.tensor(rows, device=job.grad.device)
        bias2 = second_moment_bias(group, job.step)
        exponents = self.exponents(group, stack.order)
        for j in self.sketched_dims(stack.shape, group):
            take = (lambda t: t) if index is None else (lambda t: t[index])
            values = take(state[f"sketch_values_{j}"])
            mass = take(state[f"sketch_escaped_mass_{j}"])
            inverse, tail = low_rank_root(values, mass, bias2, group["epsilon"],
                                          group["sketch_relative_epsilon"], exponents[j])
            # the root's basis is the sketch's, as stored (4 bits: the same codes)
            for source, target in stored_pairs(state, f"sketch_basis_{j}",
                                               f"sketch_root_basis_{j}"):
                put(state, target, take(state[source]), index)
            put(state, f"sketch_root_values_{j}", inverse, index)
            put(state, f"sketch_root_tail_{j}", tail, index)

    # ------------------------------------------------------------------ direction
    def precondition(self, stack, job, filtered: Tensor, out: Tensor, scratch: Scratch) -> Tensor:
        """The sketched dims' low-rank roots (the products along different dims commute),
        then Shampoo's roots of the full dims."""
        sketched = self.sketched_dims(stack.shape, job.group)
        if not sketched:
            return super().precondition(stack, job, filtered, out, scratch)
        state = job.state
        x = filtered.to(job.group["factor_matrix_dtype"])
        for j in sketched:
            x = low_rank_mode_product(x, load_basis(state, f"sketch_root_basis_{j}",
                                                    stack.shape[j]),
                                      state[f"sketch_root_values_{j}"],
                                      state[f"sketch_root_tail_{j}"], j)
        return super().precondition(stack, job, x, out, scratch)


def load_basis(state: dict, name: str, d: int, rows: list[int] | None = None) -> Tensor:
    """The basis ``name`` (n, d, k) of ``rows`` (None: all): the state's tensor, or where it
    is kept in 4 bits (``quantization="4bit"``: its k directions as rows of d) dequantised
    with one Björck step, as 4-bit Shampoo's eigenvectors."""
    if name in state:
        return state[name] if rows is None else state[name][rows]
    sub = {key: state[key] if rows is None else state[key][rows]
           for key in (f"{name}_codes", f"{name}_scales")}
    return quantization.bjorck(quantization.load(sub, name, d), 1).mT


def stored_pairs(state: dict, source: str, target: str) -> list[tuple[str, str]]:
    """The state entries that hold ``source`` and ``target``, pair by pair (one tensor each,
    or a 4-bit one's codes and scales)."""
    if source in state:
        return [(source, target)]
    return [(f"{source}_{x}", f"{target}_{x}") for x in ("codes", "scales")]


def put(state: dict, name: str, value: Tensor, index: Tensor | None = None) -> None:
    """Write ``value`` into the state entry ``name`` (the rows ``index``, or all); a basis
    kept in 4 bits is quantised (its columns as rows)."""
    if name not in state:
        quantization.store(state, name, value.mT.contiguous(), index)
    elif index is None:
        state[name].copy_(value)
    else:
        state[name].index_copy_(0, index, value)


def frequent_directions(basis: Tensor, values: Tensor, mass: Tensor, x: Tensor,
                        beta2: float) -> tuple[Tensor, Tensor, Tensor, list[bool]]:
    """One Frequent-Directions step per row: the sketch ``U diag(σ)`` (``basis`` (n, d, k),
    ``values`` (n, k)) and escaped mass ``ρ`` (n,) after the new columns ``x`` (n, d, m),
    and which rows' SVD succeeded.

    Rows whose input is not finite get NaN results (the caller's check raises on them).
    Rows whose SVD fails (LAPACK raises in their own dtype and in float64) keep their
    previous sketch: that step's gradient does not enter it."""
    n, d, k = basis.shape
    decay = math.sqrt(beta2)
    weight = 1.0 if beta2 == 1.0 else 1.0 - beta2
    sketch = basis * (values * decay).unsqueeze(1)
    columns = x if weight == 1.0 else x * math.sqrt(weight)
    stacked = torch.cat([sketch, columns.to(sketch.dtype)], dim=2)  # (n, d, k + m)
    # without a host sync: non-finite rows decompose zeros and come out NaN
    finite = torch.isfinite(stacked).flatten(1).all(dim=1).view(n, 1, 1)
    stacked = torch.where(finite, stacked, torch.zeros_like(stacked))
    svd = linalg.batched_svd(stacked)  # u (n, d, r), r >= k; per matrix on the CPU
    u, s = svd.u, svd.s
    top = s[:, :k].clamp(min=0)
    cutoff = s[:, k].clamp(min=0) if s.shape[1] > k else torch.zeros_like(s[:, 0])
    c = cutoff.unsqueeze(1)
    deflated = (top - c).clamp(min=0).sqrt() * (top + c).sqrt()
    mask = deflated > 0
    new_basis = u[:, :, :k] * mask.unsqueeze(1)
    new_values = deflated * mask
    new_mass = mass * decay + cutoff.square()
    if not all(svd.ok):  # the failed rows keep what they had
        kept = torch.tensor([not ok for ok in svd.ok], device=basis.device)
        new_basis = torch.where(kept.view(n, 1, 1), basis, new_basis)
        new_values = torch.where(kept.view(n, 1), values, new_values)
        new_mass = torch.where(kept, mass, new_mass)
    nan = torch.full((), math.nan, dtype=new_basis.dtype, device=new_basis.device)
    return (torch.where(finite, new_basis, nan), torch.where(finite.view(n, 1), new_values, nan),
            torch.where(finite.view(n), new_mass, nan), svd.ok)


def low_rank_root(values: Tensor, mass: Tensor, bias2: float, epsilon: float, relative: bool,
                  exponent: float) -> tuple[Tensor, Tensor]:
    """``(λ + ε)^(-e)`` on the sketch's basis (0 on its zeroed columns) and
    ``(ρ/bc2 + ε)^(-e)`` on its complement (0 without escaped mass), with
    ``λ = (σ² + ρ) / bc2`` (the reference's "undeflated" eigenvalues)."""
    mask = values > 0
    eigenvalues = (values.square() + mass.unsqueeze(1)) / bias2
    tail = mass / bias2
    if relative and epsilon > 0:
        eps = eigenvalues.amax(dim=1, keepdim=True) * epsilon
    else:
        eps = torch.full_like(tail.unsqueeze(1), epsilon)
    inverse = linalg.power(eigenvalues + eps, -exponent)
    inverse = torch.where(mask, inverse, torch.zeros_like(inverse))
    tail_root = linalg.power(tail + eps.squeeze(1), -exponent)
    tail_root = torch.where(tail > 0, tail_root, torch.zeros_like(tail_root))
    return inverse, tail_root


def low_rank_mode_product(x: Tensor, basis: Tensor, inverse: Tensor, tail: Tensor,
                          dim: int) -> Tensor:
    """``X ×_dim (U diag(v) Uᵀ + τ (I − U Uᵀ))`` per block, as
    ``τ X + U diag(v − τ) Uᵀ X`` (never a ``d × d`` matrix)."""
    n = x.shape[0]
    columns = unfold(x, dim)  # (n, d, m)
    # _bmm: one-column products (1-D blocks) rounded alike for any stack size
    projected = _bmm(basis.mT, columns)  # (n, k, m)
    projected.mul_((inverse - tail.unsqueeze(1)).unsqueeze(2))
    result = _bmm(basis, projected).add_(columns * tail.view(n, 1, 1))
    if x.dim() == 2:
        return result.squeeze(-1)
    moved_shape = list(x.movedim(dim + 1, 1).shape)
    return result.reshape(moved_shape).movedim(1, dim + 1).contiguous()
