"""``diagonal_aspect``: a matrix block whose long side is at least that many times its short
side (a LoRA adapter's ``d × r``) keeps the long side's factor as its diagonal. Checked
against a dense float64 formula, for memory, validation and exact resume."""

from __future__ import annotations

import pytest
import torch

from hf_shampoo import DistributedShampoo
from hf_shampoo.describe_table import describe_rows
from tests.helpers import assert_resumes_exactly, generator

pytestmark = pytest.mark.unit


def _root(eigenvalues: torch.Tensor, vectors: torch.Tensor | None, epsilon: float, e: float):
    """The inverse root as docs/design.md §2 defines it, from the eigenvalues of A + εI
    (shifted when the smallest is below ε)."""
    smallest = eigenvalues.min()
    lam = (eigenvalues - smallest) + epsilon if smallest < epsilon else eigenvalues
    if vectors is None:
        return lam.pow(-e)  # a diagonal matrix: its entries are its eigenvalues
    return vectors @ torch.diag(lam.pow(-e)) @ vectors.T


def test_the_long_side_is_diagonal_as_the_formula_says():
    gen = generator(3)
    d, r, steps, lr, beta2, eps = 24, 3, 5, 0.05, 0.99, 1e-6
    init = torch.randn(d, r, generator=gen, dtype=torch.float64)
    grads = [torch.randn(d, r, generator=gen, dtype=torch.float64) for _ in range(steps)]
    param = torch.nn.Parameter(init.clone())
    opt = DistributedShampoo([param], lr=lr, betas=(0.0, beta2), epsilon=eps,
                             precondition_frequency=1, start_preconditioning_step=1,
                             factor_matrix_dtype=torch.float64, diagonal_aspect=4,
                             max_preconditioner_dim=24)  # (24, 3) is not merged into (72,)
    w = init.clone()
    left, right = torch.zeros(d, dtype=torch.float64), torch.zeros(r, r, dtype=torch.float64)
    for t, g in enumerate(grads, start=1):
        param.grad = g.clone()
        opt.step()
        left = beta2 * left + (1 - beta2) * g.square().sum(dim=1)
        right = beta2 * right + (1 - beta2) * g.T @ g
        bc = 1 - beta2**t
        values, vectors = torch.linalg.eigh(right / bc + eps * torch.eye(r, dtype=torch.float64))
        p = _root(left / bc + eps, None, eps, 0.25)[:, None] * g @ _root(values, vectors, eps,
                                                                        0.25)
        w = w - lr * p
    torch.testing.assert_close(param.detach(), w, rtol=1e-10, atol=1e-12)
    state = opt.state_dict()["state"][0]
    assert state["block_0.factor_matrix_0"].shape == (d,)  # the long side: diagonal
    assert state["block_0.factor_matrix_1"].shape == (r, r)


def test_only_blocks_of_extreme_aspect_get_a_diagonal_side():
    shapes = {"adapter": (64, 4), "wide adapter": (4, 64), "square": (16, 16), "mild": (32, 8)}
    params = {k: torch.nn.Parameter(torch.zeros(s)) for k, s in shapes.items()}
    opt = DistributedShampoo(list(params.items()), lr=0.1, diagonal_aspect=8,
                             max_preconditioner_dim=64)  # no block is merged into one dim
    for p in params.values():
        p.grad = torch.ones_like(p)
    opt.step()
    state = opt.state_dict()["state"]
    factor_shapes = [tuple(state[i][f"block_0.factor_matrix_{j}"].shape)
                     for i in range(4) for j in (0, 1)]
    assert factor_shapes == [(64,), (4, 4), (4, 4), (64,), (16, 16), (16, 16), (32, 32), (8, 8)]
    labels = [row["preconditioner"] for row in describe_rows(opt)]
    assert labels == ["shampoo (dim 0 diagonal)", "shampoo (dim 1 diagonal)", "shampoo",
                      "shampoo"]


def test_an_adapter_holds_at_most_three_times_adamws_state():
    d, r = 768, 4
    adapter = torch.nn.Parameter(torch.zeros(d, r))
    opt = DistributedShampoo([adapter], lr=1e-3, grafting="adam", betas=(0.9, 0.999),
                             diagonal_aspect=16)
    ours = sum(row["state_bytes"] for row in opt.describe_blocks())
    adamw = 2 * 4 * d * r
    assert ours <= 3 * adamw, (ours, adamw)
    full = DistributedShampoo([adapter], lr=1e-3, grafting="adam", betas=(0.9, 0.999))
    assert sum(row["state_bytes"] for row in full.describe_blocks()) > 50 * adamw


@pytest.mark.parametrize("kw, message", [
    ({"diagonal_aspect": 0.5}, "invalid diagonal_aspect=0.5; expected a finite real number >= 1.0"),
    ({"diagonal_aspect": 8, "preconditioner": "eigenvalue_corrected"},
     "a diagonal long side exists for preconditioner='shampoo' without quantization"),
    ({"diagonal_aspect": 8, "quantization": "4bit"},
     "a diagonal long side exists for preconditioner='shampoo' without quantization"),
])
def test_invalid_settings_are_refused(kw, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        DistributedShampoo([torch.nn.Parameter(torch.zeros(8, 2))], **kw)


def test_resumes_exactly():
    def make_model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(40, 2, bias=False), torch.nn.Tanh(),
                                   torch.nn.Linear(2, 40, bias=False))

    def train(model, opt, steps, seed):
        gen = generator(seed)
        for _ in range(steps):
            x = torch.randn(8, 40, generator=gen)
            opt.zero_grad()
            (model(x) - x).square().mean().backward()
            opt.step()

    assert_resumes_exactly(
        make_model, lambda m: DistributedShampoo(m.parameters(), lr=0.01, grafting="adam",
                                                 precondition_frequency=2, diagonal_aspect=8),
        train)


def test_a_diagonal_long_side_does_not_depend_on_its_stack():
    """The diagonal long side's inverse root (``λ^(-1/4)``) has the same bits whatever
    else is stacked with the block: found by the generated ZeRO cases (world 4, a (40, 9)
    parameter cut into (8, 1) blocks owned 2 per rank) off by 1.5e-8 after 7 steps, as
    ``pow`` rounds a stack of 1-3 such blocks (its scalar tail on an AVX-512 CPU)
    otherwise than a stack of 5. Here each (8, 1) block is its own parameter: the blocks
    stepped alone or in stacks of 2, 3 and 4 end as in the stack of all 5."""
    from tests import layout_cases

    config = dict(lr=0.03, grafting="adam", diagonal_aspect=2.0, max_preconditioner_dim=8,
                  precondition_frequency=1, start_preconditioning_step=1)
    seed, steps = 1880147083, 7
    init = layout_cases.full_params([(40, 9)], seed)[0][:, 8:]
    grads = [layout_cases.full_grads([(40, 9)], seed, t, {})[0][:, 8:]
             for t in range(1, steps + 1)]

    def run(blocks):
        params = [torch.nn.Parameter(init[8 * b:8 * b + 8].clone()) for b in blocks]
        opt = DistributedShampoo(params, **config)
        for grad in grads:
            for p, b in zip(params, blocks):
                p.grad = grad[8 * b:8 * b + 8].clone()
            opt.step()
        return {b: p.detach() for b, p in zip(blocks, params)}

    everything = run(range(5))
    for blocks in ([1], [0, 1], [1, 2, 3], [0, 1, 2, 3]):
        for b, got in run(blocks).items():
            assert torch.equal(got, everything[b]), (blocks, b)
