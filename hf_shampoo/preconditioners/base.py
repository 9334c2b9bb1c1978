"""The interface every preconditioner kind implements, and the Kronecker-factor statistics
that the factored kinds share (docs/design.md §2 line 2).

A kind is a stateless object; its methods take the ``BlockStack`` (state, members,
failure counts) and the step's ``StackStep`` (rows, gradient, refresh rows). The stack
calls, in this order: ``update_statistics`` (factor matrices), ``refresh`` for the rows
whose amortized computation is due, ``after_refresh`` (statistics kept in the refreshed
basis), then ``precondition`` of the filtered gradient. Grafting, weight decay and momentum
are the shared update rules (``update_rules.py``). A kind with ``steps_on_every_rank`` also
gets ``before_step`` once per step on every rank, before all of these (for collectives,
e.g. gathering weights).

A kind also owns its configuration (docs/design.md §7): the keyword rows it introduces
(``keywords``, gathered over its classes by ``own_keywords``), the common keywords it
ignores, its cross-keyword rules (``check``), whether it refreshes, its start step and its
exponents. ``config.py`` joins the kinds' rows with the common ones into the keyword table.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..keywords import Keyword, fail
from ..kronecker import update_factor
from ..update_rules import Scratch
from .factored_keywords import FACTORED_KEYWORDS


def kinds_with(attribute: str) -> list[str]:
    """The registered kinds' names whose ``attribute`` is true (for messages)."""
    from . import KINDS  # the registry imports the kinds: read it when a rule fails

    return [name for name, kind in KINDS.items() if getattr(kind, attribute)]


def _names(names: list[str]) -> str:
    return ", ".join(map(repr, names))


class Preconditioner:
    """One kind of preconditioner (the ``preconditioner`` keyword's value)."""

    name: str = ""
    # whether the direction is rescaled to the grafting method's norm (docs/design.md §2 line 5);
    # False for a kind whose direction is the grafting direction itself
    grafted: bool = True
    # whether parameters are blocked as matrices (dim 0, the rest) instead of by merging
    matrix_blocks: bool = False
    # whether the kind has an amortized computation (refresh steps, a staggered schedule)
    refreshes: bool = True
    # whether the direction needs a grafting method to exist ("diagonal": it is the grafting
    # direction), so that vector_preconditioner gives it Adam grafting when a group has none
    needs_grafting: bool = False
    # whether it keeps Kronecker-factor statistics (the statistics keywords act on it)
    statistics: bool = False
    # what it can do, for the rules on the statistics keywords: a diagonal long side
    # (diagonal_aspect), inverse roots (the pseudo-inverse), roots by coupled iterations,
    # roots stored in inv_factor_matrix_dtype; None = 4-bit state exists for it, else why not
    diagonal_factors: bool = False
    inverse_roots: bool = False
    coupled_roots: bool = False
    root_dtype: bool = False
    not_quantizable_because: str | None = None
    # the kind whose d × d factors this kind keeps as low-rank sketches (sketchy: "shampoo"),
    # what make_optimizer(memory="sketch") turns that kind into; None for the others
    sketches: str | None = None
    # whether its statistics can be taken every statistics_frequency steps without 4-bit
    # state (sketchy: the reference's update_freq)
    samples_statistics: bool = False
    # the Trainer's AdamW migration: True for a kind whose own epsilon is Adam's and which
    # is not grafted by default there (SOAP)
    adam_like: bool = False
    # the keyword rows this class introduces (subclasses inherit them: ``own_keywords``)
    keywords: tuple[Keyword, ...] = ()
    # common keywords that change nothing for this kind
    ignores: frozenset[str] = frozenset({"epsilon", "precondition_frequency", "refresh_delay",
                                         "refresh_schedule", "start_preconditioning_step"})

    @property
    def quantizable(self) -> bool:
        """Whether 4-bit state exists for this kind."""
        return self.statistics and self.not_quantizable_because is None

    @classmethod
    def own_keywords(cls) -> tuple[Keyword, ...]:
        """The kind-specific rows this kind reads (its classes' ``keywords``)."""
        rows: dict[str, Keyword] = {}
        for klass in reversed(cls.__mro__):
            for row in vars(klass).get("keywords", ()):
                rows[row.name] = row
        return tuple(rows.values())

    def acts(self, key: str, group: dict, kind_specific: frozenset[str]) -> bool:
        """Whether ``key`` changes anything for this kind in ``group`` (``kind_specific``:
        the keywords some kind declares)."""
        if key in kind_specific:
            return key in {row.name for row in self.own_keywords()}
        if key == "start_preconditioning_step" and not self.refreshes:
            return group["grafting"] is not None  # its warm-up is the grafting method alone
        return key not in self.ignores

    def rule_keywords(self, shape_role: str, effective: dict) -> dict | None:
        """The module rules' keywords for a parameter given this kind by an override
        (``shape_role``: "vector", "matrix", ...), or None to let the preset decide."""
        return None

    def describe_label(self, name: str, group: dict) -> str | None:
        """What ``describe()`` adds to this kind's name for the parameter ``name``, or None."""
        return None

    @classmethod
    def start_step(cls, group: dict) -> int:
        """The first preconditioned step ``s``: ``start_preconditioning_step``, else
        ``precondition_frequency`` for a kind that refreshes, 1 for one that does not
        (it has nothing to accumulate first)."""
        start = group["start_preconditioning_step"]
        if start is None:
            return group["precondition_frequency"] if cls.refreshes else 1
        return int(start)

    def exponents(self, group: dict, order: int) -> list[float]:
        """Exponent ``e_j`` of each dim of a block of this order (0 leaves the dim alone)."""
        return [0.0] * order

    def check(self, group: dict) -> None:
        """Raise ``ValueError`` for a cross-keyword rule ``group`` breaks (its rows are
        valid on their own). These rules hold whatever the kind."""
        start, f = group["start_preconditioning_step"], group["precondition_frequency"]
        if start is not None and self.refreshes and start < f:
            fail("start_preconditioning_step", start,
                 f"expected None or an integer >= precondition_frequency ({f})")
        mode, epsilon = group["rank_deficient"], group["epsilon"]
        if mode == "perturbation" and not epsilon > 0:
            fail("epsilon", epsilon, "expected a finite real number > 0.0")
        if mode == "pseudo_inverse" and epsilon != 0:
            fail("epsilon", epsilon, "expected 0.0 with rank_deficient='pseudo_inverse' (the "
                 "pseudo-inverse drops the directions at or below the rank cutoff instead "
                 "of adding epsilon)")
        quantized = group["quantization"] == "4bit"
        delay = group.get("refresh_delay", 0)
        if delay and self.refreshes:
            s = self.start_step(group)
            gap = f - s % f if s % f else f
            if delay > gap:
                fail("refresh_delay", delay, f"expected an integer in [0, {gap}]: at most the "
                     f"steps between two refreshes (precondition_frequency={f}, first "
                     f"refresh at step {s}), so that a block has one refresh pending at a time")
            if quantized:
                fail("refresh_delay", delay, "expected 0 with quantization='4bit': a 4-bit "
                     "refresh rebuilds the factor statistics themselves (sampled into their "
                     "eigendecomposition), which a later step would overwrite")
        for key, what in (("statistics_frequency", "how often 4-bit factors or sketches "
                                                   "are sampled"),
                          ("statistics_warmup", "how many first steps sample every gradient "
                                                "into 4-bit factors")):
            sampled = key == "statistics_frequency" and self.samples_statistics
            if not quantized and not sampled and group[key] is not None:
                also = " or preconditioner='sketchy'" if key == "statistics_frequency" else ""
                fail(key, group[key], f"it sets {what}: expected None unless "
                     f"quantization='4bit'{also} (32-bit factors take every gradient)")
        every = group["statistics_frequency"]
        if (quantized or self.samples_statistics) and every is not None and f % every != 0:
            fail("statistics_frequency", every,
                 f"expected None or a divisor of precondition_frequency ({f})")
        if quantized and group["factor_matrix_dtype"] != torch.float32:
            fail("quantization", "4bit", "4-bit state keeps its eigenvalues in float32: "
                 "factor_matrix_dtype must be torch.float32")
        aspect = group["diagonal_aspect"]
        if aspect is not None and not (self.diagonal_factors and not quantized):
            fail("diagonal_aspect", aspect, "a diagonal long side exists for preconditioner="
                 f"{_names(kinds_with('diagonal_factors'))} without quantization: expected "
                 f"None here (preconditioner={group['preconditioner']!r}, "
                 f"quantization={group['quantization']!r})")

    def preconditioned_dims(self, group: dict, order: int) -> list[int]:
        """Dims with a Kronecker factor."""
        return [j for j, e in enumerate(self.exponents(group, order)) if e != 0]

    def step_flops(self, shape: tuple[int, ...], group: dict) -> float:
        """What one block of this shape costs its owner per step, in floating-point
        operations (the ``"compute"`` assignment cost): a factor update and a
        preconditioning product per factored dim, each ``2 d · numel``, and an amortized
        refresh of about ``10 d³`` per ``precondition_frequency`` steps; elementwise
        passes (about ``10 · numel``) for every kind."""
        numel = math.prod(shape)
        flops = 10.0 * numel
        frequency = max(int(group.get("precondition_frequency", 1) or 1), 1)
        for j in self.preconditioned_dims(group, len(shape)):
            d = shape[j]
            flops += 4.0 * d * numel + 10.0 * d**3 / frequency
        return flops

    def keeps_basis(self, group: dict) -> bool:
        """Whether eigenvectors are state."""
        return False

    def state_shapes(self, stack, group: dict) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Name → (per-block shape, dtype) of the kind's state (names: ``stack.py``)."""
        return {}

    def initial_state(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, n: int,
                      device: torch.device) -> Tensor:
        """The value of a new state tensor for ``n`` blocks: identity roots and bases,
        zeros elsewhere."""
        if name.startswith(("inverse_root_", "eigenvectors_")) and len(shape) == 2:
            return torch.eye(shape[0], dtype=dtype, device=device).repeat(n, 1, 1)
        if name.startswith("inverse_root_") and len(shape) == 1:  # a diagonal root
            return torch.ones((n, *shape), dtype=dtype, device=device)
        return torch.zeros((n, *shape), dtype=dtype, device=device)

    def factor_dims(self, stack, group: dict) -> list[int]:
        """Dims whose factor matrix is state, updated every step (docs/design.md §2 line 2)."""
        return self.preconditioned_dims(group, stack.order)

    def statistics_input(self, state: dict, group: dict, g: Tensor, dim: int, order: int,
                         rows: list[int] | None = None) -> Tensor:
        """What factor ``dim``'s statistics are built from (``rows``: of the state)."""
        return g

    def checked_factors(self, stack, job) -> dict[str, Tensor]:
        """This step's factor matrices of the refreshing rows, out of place (to check them
        for non-finite values before anything changes)."""
        return {}

    # whether ``before_step`` has work to do (the step calls it only for such kinds)
    steps_on_every_rank: bool = False

    def before_step(self, stacks: list, groups: list[dict], distributor) -> None:
        """The per-step hook of a kind with ``steps_on_every_rank``: called once per step on
        every rank, after the non-finite check and before any gradient is gathered or
        direction computed (``step.before_step``), with every stack of this kind in
        the layout (all ranks' stacks, in the layout's order: the same list everywhere),
        so that collectives issued here in that order match across ranks. The parameters
        are this step's (they change only in the distributor's ``finish_step``). Whatever
        it prepares for its owned stacks it keeps on them. Nothing by default."""

    def update_statistics(self, stack, job, g: Tensor, scratch: Scratch) -> None:
        """Line 2: the factor statistics of every row of the job (``g``: factor dtype)."""

    def refresh(self, stack, job, rows: list[int], first: bool, workspace) -> None:
        """Line 2's amortized computation for ``rows`` (``first``: their first one)."""

    def after_refresh(self, stack, job, g: Tensor, scratch: Scratch) -> None:
        """Statistics that live in the (possibly refreshed) basis."""

    # ------------------------------------------------ refresh_delay (delayed_refresh.py)
    def delayed_extras(self, stack, group: dict) -> dict[str, tuple[tuple[int, ...],
                                                                    torch.dtype]]:
        """What a delayed refresh hands over besides the state it writes (name → per-block
        shape, dtype); nothing by default."""
        return {}

    def initial_delayed(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, n: int,
                        device: torch.device) -> Tensor:
        """The value of an extra of ``delayed_extras`` before the refresh fills it."""
        raise NotImplementedError(name)

    def apply_delayed(self, state: dict, index: Tensor, result: dict[str, Tensor]) -> None:
        """Write a delayed refresh's ``result`` into the state rows ``index``."""
        for name, value in result.items():
            state[name].index_copy_(0, index, value.to(state[name].dtype))

    def precondition(self, stack, job, filtered: Tensor, out: Tensor, scratch: Scratch) -> Tensor:
        """Line 5 before grafting: ``P`` of the filtered gradient, into ``out`` if it can."""
        raise NotImplementedError


class KroneckerFactored(Preconditioner):
    """Kinds with a factor matrix ``F_j = β2 F_j + (1-β2) X_(j) X_(j)ᵀ`` per dim
    (docs/design.md §2)."""

    statistics = True
    keywords = FACTORED_KEYWORDS
    ignores = frozenset()

    def default_exponent(self, order: int) -> float:
        """A dim's exponent without ``inverse_exponent_override``: ``1/(2k)``."""
        return 1.0 / (2 * order)

    # whether ``{order: e}`` (no per-dim dict) sets the dims' exponents
    scalar_override_sets_dims: bool = True

    def exponents(self, group: dict, order: int) -> list[float]:
        """``default_exponent`` unless ``inverse_exponent_override`` says otherwise."""
        override = (group["inverse_exponent_override"] or {}).get(order)
        default = self.default_exponent(order)
        if isinstance(override, dict):
            return [float(override.get(j, default)) for j in range(order)]
        if override is not None and self.scalar_override_sets_dims:
            return [float(override)] * order
        return [default] * order

    def check(self, group: dict) -> None:
        """The rules of the statistics keywords: 4-bit state, root dtype, pseudo-inverse and
        coupled root iterations where the kind has them."""
        super().check(group)
        kind, quantization = group["preconditioner"], group["quantization"]
        if quantization == "4bit" and self.not_quantizable_because:
            fail("quantization", "4bit", "4-bit state exists for preconditioner "
                 f"{_names(kinds_with('quantizable'))} (and has no effect with the kinds "
                 f"without statistics), not for {kind!r}: {self.not_quantizable_because}")
        if group["inv_factor_matrix_dtype"] is not None and not (
                self.root_dtype and quantization is None):
            fail("inv_factor_matrix_dtype", group["inv_factor_matrix_dtype"],
                 "it sets the dtype of the inverse roots of preconditioner="
                 f"{_names(kinds_with('root_dtype'))} without quantization (and has no "
                 "effect with the kinds without statistics): expected None here "
                 f"(preconditioner={kind!r}, quantization={quantization!r})")
        if group["rank_deficient"] == "pseudo_inverse" and not self.inverse_roots:
            fail("rank_deficient", "pseudo_inverse", "the pseudo-inverse is for the inverse "
                 f"roots of preconditioner {_names(kinds_with('inverse_roots'))}: "
                 f"with {kind!r}, "
                 "epsilon is the corrected second moment's and must be > 0; expected "
                 "'perturbation' here")
        self._check_root_inverse(group)

    def _check_root_inverse(self, group: dict) -> None:
        """The coupled iterations need integer roots and compute the roots alone (no
        eigenvectors: no QR, criterion, 4-bit or pseudo-inverse)."""
        solver = group["root_inverse"]
        if solver == "eigh":
            return
        where = f"root_inverse={solver!r} computes inverse roots by matrix products"
        if not self.coupled_roots:
            fail("root_inverse", solver, f"{where}, for preconditioner "
                 f"{' or '.join(map(repr, kinds_with('coupled_roots')))}: expected 'eigh' "
                 f"with {group['preconditioner']!r}")
        for key, plain in (("quantization", None), ("eigendecomposition", "eigh"),
                           ("eigenbasis_tolerance", 0.0), ("rank_deficient", "perturbation")):
            if group[key] != plain:
                fail(key, group[key], f"{where} and keeps no eigenvectors or eigenvalues: "
                     f"expected {plain!r} with it")
        for order, entry in (group["inverse_exponent_override"] or {}).items():
            exponents = entry.values() if isinstance(entry, dict) else [entry]
            for e in exponents:
                if e != 0 and abs(1 / e - round(1 / e)) > 1e-9:
                    fail("inverse_exponent_override", group["inverse_exponent_override"],
                         f"{where}: every exponent must be 1/p for an integer p (or 0), "
                         f"got {e} for order {order}")

    def state_shapes(self, stack, group: dict) -> dict:
        shapes = {}
        for j in self.factor_dims(stack, group):
            d = stack.shape[j]
            shapes[f"factor_matrix_{j}"] = ((d, d), group["factor_matrix_dtype"])
        return shapes

    def checked_factors(self, stack, job) -> dict[str, Tensor]:
        """When every row refreshes, ``update_statistics`` adopts these (``job.new_factors``)
        instead of updating again; otherwise they only serve the check, and the factors of
        all rows are updated in place (a row's product does not depend on its batch)."""
        group, rows = job.group, job.refresh_rows
        everything = len(rows) == job.grad.shape[0]
        g = job.grad.to(group["factor_matrix_dtype"])
        if not everything:
            g = g[rows]
        factors = {}
        for j in self.factor_dims(stack, group):
            factor = job.state[f"factor_matrix_{j}"]
            factor = factor if everything else factor[rows]
            source = self.statistics_input(job.state, group, g, j, stack.order,
                                           None if everything else rows)
            factors[f"factor_matrix_{j}"] = update_factor(
                factor, source, j, group["betas"][1], out_of_place=True)
        return factors

    def update_statistics(self, stack, job, g: Tensor, scratch: Scratch) -> None:
        state, group = job.state, job.group
        if job.new_factors is not None:
            state.update(job.new_factors)
            return
        unfold_into = scratch("scratch") if g is job.grad else None
        dims = self.factor_dims(stack, group)
        # every dim's input from the state before this step (KL: the current roots)
        inputs = {j: self.statistics_input(state, group, g, j, stack.order) for j in dims}
        for j in dims:
            update_factor(state[f"factor_matrix_{j}"], inputs[j], j, group["betas"][1],
                          scratch=unfold_into)
