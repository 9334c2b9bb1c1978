"""Fused mixture-of-experts weights: ``experts=True`` blocks a parameter
``(E, out, in)`` as ``E`` matrices, and the module rules set it for transformers' experts
modules, so that no factor or orthogonalization couples two experts."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hf_shampoo import DistributedShampoo
from hf_shampoo.blocking import ParamBlocking
from hf_shampoo.describe_table import describe, describe_rows
from hf_shampoo.factory import make_optimizer
from hf_shampoo.integrations.transformers.arguments import parse_optim_args
from hf_shampoo.model_rules import is_experts_module, param_groups, walk
from tests.helpers import assert_resumes_exactly

pytestmark = pytest.mark.unit

# transformers 4.x keeps one nn.Linear per expert (ordinary matrices, nothing fused to cut)
transformers = pytest.importorskip(
    "transformers", minversion="5.0",
    reason="fused experts weights (E, out, in) are transformers 5's; 4.x has one Linear each")
MixtralConfig, MixtralForCausalLM = transformers.MixtralConfig, transformers.MixtralForCausalLM
Qwen3MoeConfig, Qwen3MoeForCausalLM = transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM

EXPERTS = 4


def tiny_mixtral() -> nn.Module:
    torch.manual_seed(0)
    config = MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=48,
                           num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                           num_local_experts=EXPERTS, num_experts_per_tok=2)
    return MixtralForCausalLM(config)


def tiny_qwen3_moe() -> nn.Module:
    torch.manual_seed(0)
    config = Qwen3MoeConfig(vocab_size=64, hidden_size=32, moe_intermediate_size=24,
                            intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=8, num_experts=EXPERTS,
                            num_experts_per_tok=2, decoder_sparse_step=1)
    return Qwen3MoeForCausalLM(config)


MODELS = {"mixtral": tiny_mixtral, "qwen3_moe": tiny_qwen3_moe}


def expert_params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p for n, p in model.named_parameters()
            if n.endswith(("experts.gate_up_proj", "experts.down_proj"))}


def run(make_model, preset: str, changed_expert: int | None, steps: int = 3,
        overrides=None) -> nn.Module:
    """``steps`` steps on fixed random gradients; ``changed_expert``: that expert's slice of
    every experts weight gets other gradients."""
    model = make_model()
    kwargs = {"lr": 1e-2} if preset == "muon" else {"lr": 1e-2, "grafting": "adam"}
    optimizer = make_optimizer(model, preset, overrides, **kwargs)
    experts = set(expert_params(model).values())
    for step in range(steps):
        gen = torch.Generator().manual_seed(step)
        other = torch.Generator().manual_seed(1000 + step)
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=gen)
            if p in experts and changed_expert is not None:
                p.grad[changed_expert] = torch.randn(p.shape[1:], generator=other)
        optimizer.step()
    return model


@pytest.mark.parametrize("family", list(MODELS))
@pytest.mark.parametrize("preset", ["transformer", "muon"])
def test_expert_zero_ignores_expert_one(family, preset):
    """Gradients that differ only in expert 1 move expert 0 bit for bit the same; before,
    one factor (or one orthogonalization) over all experts moved it by up to 7e-3."""
    a = expert_params(run(MODELS[family], preset, None))
    b = expert_params(run(MODELS[family], preset, 1))
    assert len(a) == 2
    for name in a:
        assert torch.equal(a[name][0], b[name][0]), name
        assert torch.equal(a[name][2:], b[name][2:]), name
        assert not torch.equal(a[name][1], b[name][1]), name
    # the check can fail: the same runs with the experts merged (the old rule) couple them
    c = expert_params(run(MODELS[family], preset, None, overrides={"*experts*": {
        "experts": False}}))
    d = expert_params(run(MODELS[family], preset, 1, overrides={"*experts*": {
        "experts": False}}))
    assert any(not torch.equal(c[n][0], d[n][0]) for n in c)


def test_walk_marks_experts_by_module_not_ndim():
    """Transformers' experts modules are recognised; a plain conv1d kernel and a 3-D
    parameter of another module are not, and keep the old blocking."""
    model = tiny_mixtral()
    marked = {info.name: info.experts for info in walk(model)}
    assert [n for n, e in marked.items() if e] == list(expert_params(model))
    assert is_experts_module(model.model.layers[0].mlp.experts)
    assert not is_experts_module(model.model.layers[0].mlp)

    class Mixer(nn.Module):  # a 3-D parameter whose dim 0 is not experts
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(4, 96, 32))

    plain = nn.Sequential(nn.Conv1d(4, 8, 3), Mixer())
    assert not any(info.experts for info in walk(plain))
    groups = param_groups(plain)
    assert not any(group.get("experts") for group in groups)
    optimizer = make_optimizer(plain)
    rows = {r["name"]: r for r in describe_rows(optimizer)}
    for name, p in plain.named_parameters():
        expected = ParamBlocking.of(p.shape, 1024).block_shapes
        assert rows[name]["block_shapes"] == expected and rows[name]["experts"] == 0
    assert rows["1.weight"]["block_shapes"] == [(384, 32)]  # merged, as before
    assert "experts" not in describe(optimizer)


def test_blocking_per_expert():
    """E copies of one expert's blocking in one merged view, boundaries restarting at each
    expert: shampoo merges (96, 32)'s dims only within an expert, cuts restart at rows 96."""
    one = ParamBlocking.of((96, 32), 64)
    four = ParamBlocking.of((4, 96, 32), 64, experts=True)
    assert four.merged == (384, 32)
    assert four.block_shapes == one.block_shapes * 4
    assert [s[0].start for s in four.slices] == [0, 64, 96, 160, 192, 256, 288, 352]
    small = ParamBlocking.of((4, 8, 4), 1024, experts=True)  # each expert merged to (32,)
    assert small.merged == (128,) and small.block_shapes == [(32,)] * 4
    muon = ParamBlocking.of((4, 8, 3, 2), 2**31 - 1, matrix=True, experts=True)
    assert muon.merged == (32, 6) and muon.block_shapes == [(8, 6)] * 4
    weight = torch.arange(4 * 96 * 32.0).reshape(4, 96, 32)
    views = four.views(weight)
    assert torch.equal(views[2], weight[1, :64]) and torch.equal(views[3], weight[1, 64:])


@pytest.mark.parametrize("kwargs", [
    {"preconditioner": "shampoo", "grafting": "adam", "max_preconditioner_dim": 64},
    {"preconditioner": "eigenvalue_corrected", "betas": (0.9, 0.95)},
    {"preconditioner": "spectral_descent", "spectral_lr_adjustment": "match_rms_adamw",
     "beta3": 0.81},
])
def test_experts_equal_separate_matrices(kwargs):
    """One fused ``(E, out, in)`` parameter with ``experts=True`` moves exactly as ``E``
    separate ``(out, in)`` parameters: the same blocks in the same order form the same
    stack, so the batched computation is the same, bit for bit."""
    torch.manual_seed(0)
    fused = nn.Parameter(torch.randn(EXPERTS, 96, 32))
    separate = [nn.Parameter(fused.detach()[e].clone()) for e in range(EXPERTS)]
    a = DistributedShampoo([fused], lr=1e-2, experts=True, **kwargs)
    b = DistributedShampoo(separate, lr=1e-2, **kwargs)
    for step in range(4):
        grad = torch.randn(fused.shape, generator=torch.Generator().manual_seed(step))
        fused.grad = grad.clone()
        for e, p in enumerate(separate):
            p.grad = grad[e].clone()
        a.step()
        b.step()
    for e in range(EXPERTS):
        assert torch.equal(fused.detach()[e], separate[e].detach()), e
    assert len(a.describe_blocks()) == len(b.describe_blocks()) == EXPERTS * (
        2 if kwargs.get("max_preconditioner_dim") == 64 else 1)


@pytest.mark.parametrize("preset", ["transformer", "muon"])
def test_describe_says_per_expert(preset):
    optimizer = make_optimizer(tiny_mixtral(), preset)
    text = describe(optimizer)
    line = next(row for row in text.splitlines() if "experts.gate_up_proj" in row)
    assert "4 experts, each 1x(96, 32)" in line
    rows = {r["name"]: r for r in describe_rows(optimizer)}
    assert rows["model.layers.0.mlp.experts.down_proj"]["experts"] == EXPERTS
    assert rows["model.layers.0.self_attn.q_proj.weight"]["experts"] == 0


@pytest.mark.parametrize("preset", ["transformer", "muon"])
def test_checkpoint_round_trip(preset):
    def train(model, optimizer, steps, seed):
        for step in range(steps):
            gen = torch.Generator().manual_seed(100 * seed + step)
            for p in model.parameters():
                p.grad = torch.randn(p.shape, generator=gen)
            optimizer.step()

    kwargs = {"lr": 1e-2} if preset == "muon" else {"lr": 1e-2, "grafting": "adam"}
    saved = assert_resumes_exactly(tiny_mixtral, lambda m: make_optimizer(m, preset, **kwargs),
                                   train)
    experts_groups = [g for g in saved["param_groups"] if g.get("experts")]
    assert len(experts_groups) == 1 and len(experts_groups[0]["params"]) == 2
    index = experts_groups[0]["params"][0]
    blocks = {k.split(".")[0] for k in saved["state"][index] if k.startswith("block_")}
    assert blocks == {f"block_{e}" for e in range(EXPERTS)}  # one block per expert


def test_checkpoint_refuses_other_experts_setting():
    """``experts`` decides the blocking: a checkpoint saved with it is refused without it."""
    model = tiny_mixtral()
    optimizer = make_optimizer(model, lr=1e-2)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    optimizer.step()
    state = optimizer.state_dict()
    other = make_optimizer(model, overrides={"*experts*": {"experts": False}}, lr=1e-2)
    with pytest.raises(ValueError, match="experts"):
        other.load_state_dict(state)


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_bad_experts_value(value):
    with pytest.raises(ValueError, match=rf"invalid experts={value!r}; expected True .* or "
                                         "False"):
        DistributedShampoo([nn.Parameter(torch.zeros(2, 3, 3))], experts=value)


def test_experts_needs_matrices_for_muon_and_a_dim_0():
    with pytest.raises(ValueError, match=r"fewer than 2 dims per expert \(experts=True\)"):
        DistributedShampoo([nn.Parameter(torch.zeros(4, 8))], experts=True,
                           preconditioner="spectral_descent")
    with pytest.raises(ValueError, match="experts=True"):
        DistributedShampoo([nn.Parameter(torch.zeros(()))], experts=True)


def test_optim_args_reach_experts():
    parsed = parse_optim_args("*experts*@experts=false")
    assert parsed.overrides == {"*experts*": {"experts": False}}


# ---------------------------------------------------------------------- two ranks (gloo)
DIST_SHAPES = [(4, 6, 5), (4, 6, 5), (5, 4)]
DIST_CONFIGS = {
    # max_preconditioner_dim 4 cuts each expert's (6, 5) into 4 blocks, restarting at rows 6
    "shampoo": [{"experts": True, "grafting": "adam", "max_preconditioner_dim": 4,
                 "precondition_frequency": 2}, {}],
    "muon": [{"experts": True, "preconditioner": "spectral_descent", "beta3": 0.81},
             {"preconditioner": "diagonal", "grafting": "adam"}],
}


def _dist_train(params, config: str, **kwargs) -> tuple[list[torch.Tensor], str]:
    experts, plain = DIST_CONFIGS[config]
    optimizer = DistributedShampoo([{"params": params[:2], **experts},
                                    {"params": params[2:], **plain}], lr=1e-2, **kwargs)
    for step in range(4):
        gen = torch.Generator().manual_seed(step)
        grads = [torch.randn(shape, generator=gen) for shape in DIST_SHAPES]
        for p, grad in zip(params, grads):
            if hasattr(p, "device_mesh"):  # a DTensor: the gradient placed as its parameter
                from torch.distributed.tensor import distribute_tensor
                grad = distribute_tensor(grad, p.device_mesh, p.placements, src_data_rank=None)
            p.grad = grad
        optimizer.step()
    return [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for p in params], type(optimizer._distributor).__name__


def _full_params() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randn(shape, generator=gen) for shape in DIST_SHAPES]


def _dist_worker(rank: int, init_file: str, out_file: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=2)
    from tests.helpers import leave_gloo_world

    results = {}
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("ep",))
    for config in DIST_CONFIGS:
        ddp = [nn.Parameter(t) for t in _full_params()]
        results[f"ddp_{config}"] = _dist_train(ddp, config, distributed="ddp")
        # expert parallel: 2 experts per rank; tensor parallel: each expert's rows cut
        placements = [[Shard(0)], [Shard(1)], [Replicate()]]
        sharded = [nn.Parameter(distribute_tensor(t, mesh, placement, src_data_rank=None))
                   for t, placement in zip(_full_params(), placements)]
        results[f"ep_{config}"] = _dist_train(sharded, config)
    if rank == 0:
        torch.save(results, out_file)
    leave_gloo_world()  # rank 1 tore gloo down while rank 0 saved, and was aborted


@pytest.mark.distributed  # spawns two gloo ranks
def test_two_ranks_ddp_and_expert_parallel_bit_identical(tmp_path):
    """DDP, and experts sharded over ranks (``Shard(0)``, expert parallelism) or each
    expert's rows sharded (``Shard(1)``), move every expert bit for bit as one process."""
    import torch.multiprocessing as mp

    from tests.helpers import one_thread_per_process

    out_file = str(tmp_path / "out.pt")
    with one_thread_per_process():
        mp.spawn(_dist_worker, args=(str(tmp_path / "init"), out_file), nprocs=2, join=True)
    results = torch.load(out_file, weights_only=True)
    for config in DIST_CONFIGS:
        expected, _ = _dist_train([nn.Parameter(t) for t in _full_params()], config,
                                  distributed="none")
        for mode, kind in (("ddp", "DataParallelDistributor"), ("ep", "ShardedDistributor")):
            got, used = results[f"{mode}_{config}"]
            assert used == kind
            for i, (a, b) in enumerate(zip(got, expected)):
                assert torch.equal(a, b), (mode, config, i)


def test_gpt_oss_transposed_experts_and_expert_biases():
    """gpt-oss stores its experts transposed, with biases ``(E, out)``: every one of them
    is per expert, the biases as vectors (the grafting method alone)."""
    from transformers import GptOssConfig, GptOssForCausalLM

    torch.manual_seed(0)
    model = GptOssForCausalLM(GptOssConfig(
        vocab_size=64, hidden_size=32, intermediate_size=24, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=EXPERTS,
        num_experts_per_tok=2, layer_types=["full_attention"]))
    rows = {r["name"].rpartition(".")[2]: r for r in describe_rows(make_optimizer(model))
            if ".experts." in r["name"] or ".router." in r["name"]}
    assert {n for n, r in rows.items() if r["experts"] == EXPERTS} == {
        "gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias"}
    assert rows["gate_up_proj_bias"]["preconditioner"] == "diagonal"
    assert rows["gate_up_proj"]["block_shapes"] == [(32, 48)] * EXPERTS
    assert rows["weight"]["experts"] == 0  # the router's (E, hidden) is one matrix
