"""Tests for quantization.py and the 4-bit kinds (preconditioners/quantized.py)."""

import io

import pytest
import torch

from hf_shampoo import DistributedShampoo, quantization, stacking
from hf_shampoo.preconditioners.quantized import QuantizedShampoo
from hf_shampoo.stack import BlockStack
from tests.helpers import generator

pytestmark = [pytest.mark.unit, pytest.mark.device]

LEVELS = quantization.linear_square_levels(torch.float64)


def test_linear_square_code():
    """docs/design.md §5: sign(x)·x² over linspace(-1, 1, 16), with -1/225 replaced by an
    exact 0."""
    x = torch.linspace(-1, 1, 16, dtype=torch.float64, device=LEVELS.device)
    expected = x.sign() * x.square()
    assert len(LEVELS) == 16 and bool((LEVELS[1:] > LEVELS[:-1]).all())
    assert LEVELS[7] == 0 and float(expected[7]) == pytest.approx(-1 / 225)
    torch.testing.assert_close(torch.cat([LEVELS[:7], LEVELS[8:]]),
                               torch.cat([expected[:7], expected[8:]]), rtol=0, atol=1e-15)
    assert quantization.max_rounding_error() == pytest.approx((1 - 169 / 225) / 2)


@pytest.mark.parametrize("shape", [(3, 64, 64), (2, 5, 100), (1, 70, 7)])
def test_round_trip_error_within_the_code_bound(shape):
    """Every element within half the widest level gap of its 64-block's absmax; the block's
    absmax itself is exact; storage is 4 bits plus a float32 scale per 64 elements."""
    g = generator(0)
    x = torch.randn(*shape, generator=g) * torch.logspace(-3, 1, shape[-1])
    q = quantization.quantize(x)
    width = quantization.padded(shape[-1])
    assert q.codes.dtype == torch.uint8 and q.codes.shape == (*shape[:-1], width // 2)
    assert q.scales.shape == (*shape[:-1], width // 64)
    y = quantization.dequantize(q)
    assert y.shape == x.shape
    padded_x = torch.nn.functional.pad(x, (0, width - shape[-1]))
    absmax = padded_x.reshape(*shape[:-1], -1, 64).abs().amax(-1)
    bound = absmax.repeat_interleave(64, dim=-1)[..., : shape[-1]]
    error = (x - y).abs()
    assert bool((error <= bound * quantization.max_rounding_error() * (1 + 1e-6)).all())
    # the largest element of each block is a level (±1) times the scale: exact
    blocks = padded_x.reshape(*shape[:-1], -1, 64)
    where = blocks.abs().argmax(-1, keepdim=True)
    padded_y = torch.nn.functional.pad(y, (0, width - shape[-1])).reshape(blocks.shape)
    torch.testing.assert_close(padded_y.gather(-1, where), blocks.gather(-1, where),
                               rtol=0, atol=0)


def test_identity_and_zeros_are_exact():
    for matrix in (torch.eye(96), torch.zeros(96, 96), torch.eye(40)):
        restored = quantization.dequantize(quantization.quantize(matrix))
        assert torch.equal(restored, matrix)


def test_bjorck_restores_orthogonality_to_float32_precision():
    g = generator(1)
    u = torch.linalg.qr(torch.randn(2, 256, 256, generator=g, dtype=torch.float64))[0].float()
    v = quantization.dequantize(quantization.quantize(u.mT)).mT
    eye = torch.eye(256)
    assert (v.mT @ v - eye).abs().max() > 1e-2  # quantisation broke orthogonality
    w = quantization.bjorck(v, 4)
    assert (w.mT @ w - eye).abs().max() < 2e-6
    # and it stays close to the original eigenvectors (the code's error, not more)
    assert (w - u).norm() / u.norm() < 0.1


def _spd_with_spectrum(d, values, seed=0):
    g = generator(seed)
    u = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64))[0]
    return (u * values) @ u.T, u


def test_inverse_root_from_4bit_state_close_to_32bit():
    """A factor with a known spectrum (condition 1e4), stored as float32 eigenvalues and 4-bit
    eigenvectors, and its inverse 4th root from the dequantised eigenvectors after 4 Björck
    steps: close to the exact root, far closer than quantising the root matrix itself
    (arXiv 2405.18144, Table 1: quantise eigenvectors, not matrices)."""
    d = 128
    values = torch.logspace(0, -4, d, dtype=torch.float64)
    a, u = _spd_with_spectrum(d, values)
    exact = (u * values ** -0.25) @ u.T
    v = quantization.dequantize(quantization.quantize(u.T.float())).T
    v = quantization.bjorck(v, 4).double()
    from_vectors = (v * values ** -0.25) @ v.T
    from_matrix = quantization.dequantize(quantization.quantize(exact.float())).double()
    error = (from_vectors - exact).norm() / exact.norm()
    assert error < 0.08
    assert error < 0.6 * (from_matrix - exact).norm() / exact.norm()
    # what the optimizer stores: the root's diagonal in float32, its off-diagonal in 4 bits
    off = exact - torch.diag(exact.diagonal())
    stored = quantization.dequantize(quantization.quantize(off.float())).double()
    stored += torch.diag(exact.diagonal())
    assert (stored - exact).norm() / exact.norm() < 0.08


# ------------------------------------------------------------------- the optimizer
def _regression(quantization_kind, preconditioner="shampoo", steps=60, frequency=5, batch=64,
                **kw):
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(96, 80) * 0.1)
    b = torch.nn.Parameter(torch.zeros(80))
    g = generator(1)
    x, y = torch.randn(512, 96, generator=g), torch.randn(512, 80, generator=g)
    shampoo = preconditioner == "shampoo"
    config = dict(lr=3e-2 if shampoo else 3e-3, betas=(0.9, 0.999),
                  grafting="adam" if shampoo else None, epsilon=1e-12 if shampoo else 1e-8,
                  precondition_frequency=frequency, preconditioner=preconditioner)
    if quantization_kind == "4bit" and not shampoo:
        config["statistics_frequency"] = 1  # what the test below measures
    opt = DistributedShampoo([w, b], quantization=quantization_kind, **{**config, **kw})
    for _ in range(steps):
        i = torch.randint(0, 512, (batch,), generator=g)
        loss = ((x[i] @ w + b - y[i]) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return ((x @ w + b - y) ** 2).mean().item(), opt, (w, b)


@pytest.mark.parametrize("preconditioner", ["shampoo", "eigenvalue_corrected"])
def test_short_training_within_margin_of_32bit(preconditioner):
    """A least-squares problem (96×80 weights: two quantised factors): the 4-bit run's
    final loss within 5% of the 32-bit run's, both well below the starting loss."""
    full, *_ = _regression(None, preconditioner)
    four, opt, _ = _regression("4bit", preconditioner)
    assert abs(four - full) <= 0.05 * full
    start = _regression(None, preconditioner, steps=0)[0]
    assert four < 0.8 * start
    names = set(opt._ensure_layout().owned[0].state)
    assert "factor_eigenvectors_0_codes" in names and "factor_matrix_0" not in names


def test_soap_at_the_default_cadence_within_margin_of_32bit():
    """4-bit SOAP sampling at refresh steps after the default warm-up (every gradient up to
    the first refresh): within 5% of 32-bit SOAP's final loss."""
    full, *_ = _regression(None, "eigenvalue_corrected")
    four, *_ = _regression("4bit", "eigenvalue_corrected", statistics_frequency=None)
    assert abs(four - full) <= 0.05 * full


def test_first_refresh_roots_close_to_32bit():
    """A first refresh at step 1 sees one gradient in both (the 32-bit EMA and the 4-bit
    sample are the same factor; ε = 1e-4 because one 96×80 gradient leaves the 96×96 factor
    rank-deficient, whose root at ε = 1e-12 is round-off in the null space), so the 4-bit
    roots (float32 diagonal + 4-bit
    off-diagonal) differ from the 32-bit ones by the code's error only: within 8%
    (Frobenius), as in the known-spectrum test above."""
    _, full, _ = _regression(None, steps=1, frequency=1, epsilon=1e-4)
    _, four, _ = _regression("4bit", steps=1, frequency=1, epsilon=1e-4)
    a, b = full._ensure_layout().owned[0], four._ensure_layout().owned[0]
    for j in range(2):
        restored = QuantizedShampoo.stored_root(b.state, j, a.shape[j])
        exact = a.state[f"inverse_root_{j}"]
        assert (restored - exact).norm() / exact.norm() < 0.08


def test_first_refresh_pseudo_inverse_roots_close_to_32bit():
    """The same first refresh with rank_deficient="pseudo_inverse" (the 96×96 factor has
    rank 64 after one batch of 64): the null space is dropped in both, and the 4-bit roots
    differ from the 32-bit ones by the code's error only."""
    pinv = dict(epsilon=0.0, rank_deficient="pseudo_inverse", rank_rtol=None)
    _, full, _ = _regression(None, steps=1, frequency=1, **pinv)
    _, four, _ = _regression("4bit", steps=1, frequency=1, **pinv)
    a, b = full._ensure_layout().owned[0], four._ensure_layout().owned[0]
    for j in range(2):
        restored = QuantizedShampoo.stored_root(b.state, j, a.shape[j])
        exact = a.state[f"inverse_root_{j}"]
        assert (restored - exact).norm() / exact.norm() < 0.08
    # at most rank 64 of 96 (a perturbation's root has full rank): the left root annihilates
    # what the batch never touched
    assert torch.linalg.matrix_rank(a.state["inverse_root_0"]).item() <= 64


def test_state_is_smaller_by_more_than_6x():
    """Per 1024×1024 block, the Kronecker state beyond the grafting and momentum state:
    32-bit Shampoo keeps 2 float32 factors + 2 roots; 4-bit about 1.13 bytes per element."""
    def kronecker_bytes(q):
        w = torch.nn.Parameter(torch.zeros(1024, 1024))
        opt = DistributedShampoo([w], quantization=q, grafting="adam")
        stack = opt._ensure_layout().owned[0]
        group = opt.param_groups[0]
        return sum(nbytes for name, nbytes in stack.state_bytes(group).items()
                   if name not in ("grafting_state", "filtered_grad"))
    assert kronecker_bytes(None) / kronecker_bytes("4bit") >= 6.0


@pytest.mark.parametrize("preconditioner", ["shampoo", "eigenvalue_corrected"])
def test_checkpoint_round_trip_is_exact_and_weights_only(preconditioner):
    _, opt, params = _regression("4bit", preconditioner, steps=12)
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    kinds = {t.dtype for entry in state["state"].values() for t in entry.values()
             if isinstance(t, torch.Tensor)}
    assert torch.uint8 in kinds  # the codes are saved as they are
    clones = [torch.nn.Parameter(p.detach().clone()) for p in params]
    other = DistributedShampoo(clones, **{k: v for k, v in opt.defaults.items()})
    other.load_state_dict(state)
    g = generator(5)
    for _ in range(11):  # across the next refreshes
        grads = [torch.randn(p.shape, generator=g) for p in params]
        for o, ps in ((opt, params), (other, clones)):
            for p, gr in zip(ps, grads):
                p.grad = gr.clone()
            o.step()
    for a, b in zip(params, clones):
        assert torch.equal(a, b)


def test_bad_values_are_refused():
    w = torch.nn.Parameter(torch.zeros(80, 80))
    with pytest.raises(ValueError, match="quantization='8bit'.*None, '4bit'"):
        DistributedShampoo([w], quantization="8bit")
    with pytest.raises(ValueError, match="quantization='4bit'.*kl_shampoo"):
        DistributedShampoo([w], quantization="4bit", preconditioner="kl_shampoo")
    with pytest.raises(ValueError, match="quantization='4bit'.*float32"):
        DistributedShampoo([w], quantization="4bit", factor_matrix_dtype=torch.float64)
    with pytest.raises(ValueError, match="statistics_frequency=None.*eigenvalue-corrected.*"
                                         "statistics_warmup=0"):
        DistributedShampoo([w], quantization="4bit", preconditioner="eigenvalue_corrected",
                           statistics_warmup=0)
    # with the default warm-up the default cadence is accepted
    DistributedShampoo([w], quantization="4bit", preconditioner="eigenvalue_corrected")
    # the diagonal kind has no factors: 4-bit is accepted and changes nothing
    DistributedShampoo([w], quantization="4bit", preconditioner="diagonal", grafting="adam")


def test_small_factors_stay_32bit():
    """Factors with fewer than 4096 elements (here 40×40) keep the 32-bit state and update."""
    w = torch.nn.Parameter(torch.zeros(40, 96))
    opt = DistributedShampoo([w], quantization="4bit", grafting="adam")
    stack: BlockStack = opt._ensure_layout().owned[0]
    names = set(stack.expected_state(opt.param_groups[0]))
    assert {"factor_matrix_0", "inverse_root_0", "factor_eigenvalues_1",
            "inverse_root_1_diagonal"} <= names
    assert "factor_matrix_1" not in names


def test_statistics_frequency_samples_between_refreshes():
    """With statistics_frequency=1 the 4-bit factors take every gradient (the 32-bit EMA up
    to the code's error), so the roots at the first refresh (step 5) are closer to the
    32-bit ones than with one sample per refresh and no warm-up."""
    def roots(opt):
        stack = opt._ensure_layout().owned[0]
        out = []
        for j in range(2):
            if "inverse_root_0" in stack.state:
                out.append(stack.state[f"inverse_root_{j}"])
                continue
            out.append(QuantizedShampoo.stored_root(stack.state, j, stack.shape[j]))
        return out

    def error(opt, reference):
        return max(float((a - b).norm() / b.norm()) for a, b in zip(roots(opt), reference))

    full = roots(_regression(None, steps=5, frequency=5, epsilon=1e-4)[1])
    every_step = _regression("4bit", steps=5, frequency=5, epsilon=1e-4,
                             statistics_frequency=1)[1]
    once = _regression("4bit", steps=5, frequency=5, epsilon=1e-4, statistics_warmup=0)[1]
    assert error(every_step, full) < 0.1
    assert error(every_step, full) < 0.5 * error(once, full)


def test_statistics_warmup_samples_every_step_until_the_first_refresh():
    """By default every step up to the first refresh is a sample, so the first roots are
    those of 32 bits (to the code's error), after which one gradient in five enters; with
    ``statistics_warmup=0`` the first roots come from one gradient."""
    def eigenvalues(opt):
        stack = opt._ensure_layout().owned[0]
        return stack.state["factor_eigenvalues_0"].clone()

    w = torch.zeros(64, 64)
    seen = []
    opt = DistributedShampoo([torch.nn.Parameter(w)], quantization="4bit",
                             precondition_frequency=5, statistics_warmup=None)
    g = generator(3)
    for _ in range(12):
        opt.param_groups[0]["params"][0].grad = torch.randn(64, 64, generator=g)
        opt.step()
        seen.append(eigenvalues(opt))
    changed = [t + 1 for t in range(1, 12) if not torch.equal(seen[t], seen[t - 1])]
    assert changed == [2, 3, 4, 5, 10]  # warm-up 1-5 (step 1 starts them), then refreshes
    explicit = DistributedShampoo([torch.nn.Parameter(w.clone())], quantization="4bit",
                                  precondition_frequency=5, statistics_warmup=3)
    assert QuantizedShampoo.warmup_steps(explicit.param_groups[0]) == 3
    assert QuantizedShampoo.warmup_steps(opt.param_groups[0]) == 5


def test_statistics_warmup_is_validated():
    w = torch.nn.Parameter(torch.zeros(64, 64))
    with pytest.raises(ValueError, match="statistics_warmup=4.*quantization='4bit'"):
        DistributedShampoo([w], statistics_warmup=4)
    with pytest.raises(ValueError, match="statistics_warmup=-1.*integer >= 0"):
        DistributedShampoo([w], quantization="4bit", statistics_warmup=-1)
    with pytest.raises(ValueError, match="statistics_warmup=2.5"):
        DistributedShampoo([w], quantization="4bit", statistics_warmup=2.5)
    # checked before SOAP's cadence rule reads it (False would pass for 0 there)
    with pytest.raises(ValueError, match="statistics_warmup=False.*integer >= 0"):
        DistributedShampoo([w], quantization="4bit", preconditioner="eigenvalue_corrected",
                           statistics_warmup=False)
    from hf_shampoo.integrations.transformers import parse_optim_args
    assert parse_optim_args("quantization=4bit,statistics_warmup=0").kwargs[
        "statistics_warmup"] == 0


def test_statistics_frequency_is_validated():
    w = torch.nn.Parameter(torch.zeros(80, 80))
    with pytest.raises(ValueError, match="statistics_frequency=2.*quantization='4bit'"):
        DistributedShampoo([w], statistics_frequency=2)
    with pytest.raises(ValueError, match="statistics_frequency=3.*divisor of "
                                         "precondition_frequency \\(10\\)"):
        DistributedShampoo([w], quantization="4bit", precondition_frequency=10,
                           statistics_frequency=3)
    with pytest.raises(ValueError, match="statistics_frequency=0"):
        DistributedShampoo([w], quantization="4bit", statistics_frequency=0)


def test_reachable_from_optim_args_and_timm():
    from hf_shampoo.integrations import timm as hf_timm
    from hf_shampoo.integrations.transformers import parse_optim_args

    parsed = parse_optim_args("quantization=4bit,statistics_frequency=2,"
                              "precondition_frequency=4")
    assert parsed.kwargs["quantization"] == "4bit"
    assert parsed.kwargs["statistics_frequency"] == 2
    assert parse_optim_args("statistics_frequency=none").kwargs["statistics_frequency"] is None

    from timm.optim import create_optimizer_v2

    hf_timm.register()
    model = torch.nn.Sequential(torch.nn.Linear(80, 70), torch.nn.Linear(70, 10))
    opt = create_optimizer_v2(model, opt="shampoo", lr=1e-3, quantization="4bit",
                              statistics_frequency=1, precondition_frequency=2)
    assert opt.param_groups[0]["quantization"] == "4bit"
    x = torch.randn(16, 80)
    for _ in range(3):
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    stack = next(s for s in opt._ensure_layout().owned if s.shape == (70, 80))
    assert "factor_eigenvectors_0_codes" in stack.state


@pytest.mark.parametrize("min_stacks", [2, 8])
def test_a_rows_first_decomposition_does_not_depend_on_its_stack(monkeypatch, min_stacks):
    """A sample's eigendecomposition is ``eigh`` for a block's first one and QR from its
    kept basis after, decided row by row: it was decided for the whole call (``eigh`` for
    every row when one of them was at its first), so with staggered offsets a block's
    algorithm depended on which blocks shared its stack, and a data-parallel owner, which
    stacks only its own blocks, ended 0.6 away from one process after 3 steps. Found by
    the generated DDP and ZeRO cases (4-bit SOAP, staggered, precondition_frequency=3,
    a (17,) parameter in blocks of 4 on 2 ranks); here each rank's share is computed in one
    process (``distributor`` set to DDP's assignment of that rank)."""
    from hf_shampoo.distributors import SingleProcessDistributor, block_cost, greedy_assignment
    from hf_shampoo.distributors.base import owners_of_blocks

    class Owner(SingleProcessDistributor):
        """Rank ``rank`` of ``world`` under DDP's assignment: only its blocks computed."""

        def __init__(self, world: int, rank: int) -> None:
            super().__init__()
            self.world_size, self.rank = world, rank

        def assign(self, blocks, block_shapes, costs=None, slots=None, units=None):
            owners = greedy_assignment([sum(block_cost(block_shapes[i]) for i in unit)
                                        for unit in units], self.world_size)
            return owners_of_blocks(owners, units, len(block_shapes))

    monkeypatch.setattr(quantization, "MIN_QUANTIZED_ELEMENTS", 16)
    monkeypatch.setattr(stacking, "MIN_STACKS", min_stacks)  # 2: stacks of two (4,) blocks
    config = dict(lr=0.03, preconditioner="eigenvalue_corrected", betas=(0.9, 0.99),
                  epsilon=1e-8, eigendecomposition="qr", quantization="4bit",
                  statistics_frequency=1, refresh_schedule="staggered",
                  max_preconditioner_dim=4, precondition_frequency=3)
    gen = generator(5)
    init = torch.randn(17, generator=gen)
    grads = [torch.randn(17, generator=gen) for _ in range(4)]

    def run(distributor=None):
        param = torch.nn.Parameter(init.clone())
        opt = DistributedShampoo([param], distributed="none", **config)
        if distributor is not None:
            opt.distributor = distributor
        for grad in grads:
            param.grad = grad.clone()
            opt.step()
        return param.detach(), opt.describe_blocks()

    expected, _ = run()
    for rank in range(2):
        got, blocks = run(Owner(2, rank))
        owned = [b for b in blocks if b["rank"] == rank]
        assert owned
        for b in owned:
            part = slice(b["offset"][0], b["offset"][0] + b["shape"][0])
            assert torch.equal(got[part], expected[part]), (rank, b["block"])
