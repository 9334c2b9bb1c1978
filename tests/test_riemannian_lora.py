"""preconditioner="riemannian_lora": peft's LoRA factor pairs, each gradient preconditioned
by the partner's r × r Gram matrix, then Adam (docs/lora.md): the reference math, the
module rules and describe(), exact resume, and DDP, FSDP2 and HSDP on 2 gloo ranks
bit-identical to one process with the two halves of pairs on different owners (FSDP2: the
partners' full weights gathered at the start of each step), resuming exactly from the
consolidated state."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn

from hf_shampoo import DistributedShampoo
from hf_shampoo.describe_table import describe, describe_rows
from hf_shampoo.factory import make_optimizer
from hf_shampoo.preconditioners.riemannian_lora import adapter_side
from tests.helpers import assert_bitwise, join_gloo_world, leave_gloo_world, one_thread_per_process

pytestmark = pytest.mark.integrations
torch.set_num_threads(1)  # the one-process references as the one-thread ranks compute them

peft = pytest.importorskip("peft", reason="peft is a test extra")

KEYWORDS = dict(lr=0.01, betas=(0.9, 0.999), grafting="adam", grafting_beta2=0.999,
                grafting_epsilon=1e-8, epsilon=1e-6)
OVERRIDES = {"*lora_*": {"preconditioner": "riemannian_lora"}}


class Net(nn.Module):
    """An embedding, a conv and two linears: peft's three kinds of adapter pairs."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 12)
        self.conv = nn.Conv2d(1, 6, 3)
        self.fc1 = nn.Linear(12 + 6 * 4, 24)
        self.fc2 = nn.Linear(24, 5)

    def forward(self, ids, img):
        x = torch.cat([self.emb(ids).mean(1), self.conv(img).flatten(1)], 1)
        return self.fc2(torch.tanh(self.fc1(x)))


def lora_net(seed: int = 0, **config) -> nn.Module:
    torch.manual_seed(seed)
    model = Net()
    lora = peft.LoraConfig(r=3, lora_alpha=6, lora_dropout=0.0,
                           target_modules=["emb", "conv", "fc1", "fc2"], **config)
    model = peft.get_peft_model(model, lora)
    # B starts at zero in peft: give it values so that both Gram matrices act from step 1
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name or "lora_embedding_B" in name:
                p.copy_(0.1 * torch.randn(p.shape))
    return model


def data(step: int):
    g = torch.Generator().manual_seed(100 + step)
    return (torch.randint(0, 11, (8, 5), generator=g), torch.randn(8, 1, 4, 4, generator=g),
            torch.randn(8, 5, generator=g))


def loss_of(model, step: int) -> torch.Tensor:
    ids, img, y = data(step)
    return nn.functional.mse_loss(model(ids, img), y)


def train(model, opt, steps: int, start: int = 0) -> None:
    for step in range(start, start + steps):
        opt.zero_grad()
        loss_of(model, step).backward()
        opt.step()


def adapters(model) -> dict[str, torch.Tensor]:
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def reference_step(model, state: dict, step: int, lr: float, delta: float) -> None:
    """Scaled AdamW (Zhang & Pilanci, Algorithm 2) with the Gram matrices normalized by
    their mean eigenvalue, written out."""
    params = adapters(model)
    grads = {n: p.grad.clone() for n, p in params.items()}
    weights = {n: p.detach().clone() for n, p in params.items()}  # before any update
    for name, p in params.items():
        side, other = adapter_side(name)
        g = grads[name].reshape(p.shape[0], -1).double()
        q = weights[other].reshape(weights[other].shape[0], -1).double()
        gram = q.T @ q if side == "A" else q @ q.T
        mean = torch.trace(gram) / gram.shape[0]  # 0 for peft's zero-initialized factors
        gram = (gram / mean if mean > 0 else gram) + delta * torch.eye(len(gram),
                                                                        dtype=gram.dtype)
        g = torch.linalg.solve(gram, g) if side == "A" else torch.linalg.solve(gram, g.T).T
        g = g.float().reshape(p.shape)
        m, v = state.setdefault(name, (torch.zeros_like(p), torch.zeros_like(p)))
        m.mul_(0.9).add_(g, alpha=0.1)
        v.mul_(0.999).addcmul_(g, g, value=0.001)
        update = (m / (1 - 0.9**step)) / ((v / (1 - 0.999**step)).sqrt() + 1e-8)
        with torch.no_grad():
            p.sub_(lr * update)


def test_matches_scaled_adamw_written_out():
    model, ref = lora_net(), lora_net()
    opt = make_optimizer(model, overrides=OVERRIDES, **KEYWORDS)
    state: dict = {}
    for step in range(4):
        opt.zero_grad()
        ref.zero_grad()
        loss_of(model, step).backward()
        loss_of(ref, step).backward()
        opt.step()
        reference_step(ref, state, step + 1, KEYWORDS["lr"], KEYWORDS["epsilon"])
    for (name, got), want in zip(adapters(model).items(), adapters(ref).values()):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=name)


def test_rules_describe_and_state():
    model = lora_net()
    opt = make_optimizer(model, overrides=OVERRIDES, lr=0.01)
    rows = {r["name"]: r for r in describe_rows(opt)}
    for name, row in rows.items():
        if row["frozen"]:
            assert row["preconditioner"] == "-"
            continue
        assert row["grafting"] == "adam"  # the rule adds Adam's second moment
        side = adapter_side(name)[0]
        assert row["preconditioner"].startswith(f"riemannian_lora (lora_{side} of a pair, r=3")
    assert any("lora_embedding_A" in n for n in rows) and any("conv.lora_A" in n for n in rows)
    assert "lora_B of a pair" in describe(opt)
    # the state is Adam's: m and v, 8 bytes per trainable element (nothing of order d²)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert sum(r["state_bytes"] for r in opt.describe_blocks()) == 8 * trainable


def test_dora_magnitude_is_adam_and_pairs_still_paired():
    torch.manual_seed(0)
    net = Net()
    model = peft.get_peft_model(net, peft.LoraConfig(r=3, lora_alpha=6, use_dora=True,
                                                     target_modules=["fc1", "fc2"]))
    opt = make_optimizer(model, overrides=OVERRIDES, lr=0.01)
    rows = {r["name"]: r for r in describe_rows(opt) if not r["frozen"]}
    magnitude = [r for n, r in rows.items() if "lora_magnitude_vector" in n]
    assert magnitude and all(r["preconditioner"] == "diagonal" for r in magnitude)
    assert sum("of a pair" in r["preconditioner"] for r in rows.values()) == 4
    train(model, opt, 2)


def test_resume_is_exact():
    model = lora_net()
    opt = make_optimizer(model, overrides=OVERRIDES, **KEYWORDS)
    train(model, opt, 6)
    resumed = lora_net()
    first = make_optimizer(resumed, overrides=OVERRIDES, **KEYWORDS)
    train(resumed, first, 3)
    saved = first.state_dict()
    again = make_optimizer(resumed, overrides=OVERRIDES, **KEYWORDS)
    again.load_state_dict(saved)
    train(resumed, again, 3, start=3)
    assert_bitwise([p.detach() for p in adapters(resumed).values()],
                   [p.detach() for p in adapters(model).values()])
    assert_bitwise(list(again.state_dict()["state"][0].values()),
                   list(opt.state_dict()["state"][0].values()))


def test_refusals():
    model = lora_net()
    opt = DistributedShampoo([p for p in model.parameters() if p.requires_grad],
                             preconditioner="riemannian_lora", grafting="adam")
    loss_of(model, 0).backward()
    with pytest.raises(ValueError, match="no parameter names"):
        opt.step()
    model = lora_net()
    opt = DistributedShampoo([(n, p) for n, p in model.named_parameters() if p.requires_grad
                              and "emb" not in n], preconditioner="riemannian_lora",
                             grafting="adam", max_preconditioner_dim=2)
    loss_of(model, 0).backward()
    with pytest.raises(ValueError, match="max_preconditioner_dim >= 3"):
        opt.step()


def test_partner_missing_from_the_group_warns_and_falls_back_to_adam():
    model = lora_net()
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    a = [x for x in named if "fc1.lora_A" in x[0]]
    rest = [x for x in named if "fc1.lora_A" not in x[0]]
    opt = DistributedShampoo([{"params": a, "lr": 0.02}, {"params": rest}],
                             preconditioner="riemannian_lora", grafting="adam", lr=0.01)
    loss_of(model, 0).backward()
    with pytest.warns(UserWarning, match="partner"):
        opt.step()


# ----------------------------------------------------------------------------- DDP
STEPS = 5


def run_world(rank: int, world: int, init_file: str, out_dir: str) -> None:
    join_gloo_world(rank, world, init_file)
    model = lora_net()
    opt = make_optimizer(model, overrides=OVERRIDES, weight_decay=0.01, **KEYWORDS)
    train(model, opt, STEPS)  # the same full-batch gradients on every rank (DDP's all-reduce)
    opt.consolidate_state_dict(to=0)
    result = {"params": [p.detach().clone() for p in adapters(model).values()],
              "owners": {r["name"]: r["rank"] for r in opt.describe_blocks()},
              "kind": type(opt._distributor).__name__}
    if rank == 0:
        result["state_dict"] = opt.state_dict()
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    leave_gloo_world()  # together: a rank leaving early was seen to abort the other


def test_ddp_bit_identical_and_pairs_split_over_owners():
    root = tempfile.mkdtemp(prefix="hf_shampoo_lora_")
    with one_thread_per_process():
        mp.spawn(run_world, args=(2, os.path.join(root, "init"), root), nprocs=2, join=True)
    results = [torch.load(os.path.join(root, f"rank{r}.pt"), weights_only=False)
               for r in range(2)]
    model = lora_net()
    opt = make_optimizer(model, overrides=OVERRIDES, weight_decay=0.01, **KEYWORDS)
    train(model, opt, STEPS)
    expected = [p.detach() for p in adapters(model).values()]
    for result in results:
        assert result["kind"] == "DataParallelDistributor"
        assert_bitwise(result["params"], expected)
    # both halves of a pair need not share an owner: the partner's weight is on every rank
    owners = results[0]["owners"]
    split = [n for n in owners if adapter_side(n) and adapter_side(n)[0] == "A"
             and owners[n] != owners[adapter_side(n)[1]]]
    assert split, owners
    assert set(owners.values()) == {0, 1}
    # the consolidated state resumes in one process exactly as the one-process run goes on
    resumed_model = lora_net()
    with torch.no_grad():
        for p, q in zip(adapters(resumed_model).values(), results[0]["params"]):
            p.copy_(q)
    resumed = make_optimizer(resumed_model, overrides=OVERRIDES, weight_decay=0.01,
                             **KEYWORDS)
    resumed.load_state_dict(results[0]["state_dict"])
    train(resumed_model, resumed, 2, start=STEPS)
    train(model, opt, 2, start=STEPS)
    assert_bitwise([p.detach() for p in adapters(resumed_model).values()],
                   [p.detach() for p in adapters(model).values()])


# --------------------------------------------------------------------------- FSDP2
def sharded_step(model, opt, shards: dict, step: int) -> None:
    """One step of the sharded optimizer: the full-batch gradient of the plain model (the
    same on every rank), placed as FSDP2's reduce-scatter leaves it on the shards; the
    stepped shards then go back into the model for the next forward."""
    from torch.distributed.tensor import distribute_tensor

    model.zero_grad()
    loss_of(model, step).backward()
    for name, p in adapters(model).items():
        shard = shards[name]
        shard.grad = distribute_tensor(p.grad, shard.device_mesh, shard.placements)
    opt.step()
    with torch.no_grad():
        for name, p in adapters(model).items():
            p.copy_(shards[name].full_tensor())


def run_fsdp_world(rank: int, world: int, init_file: str, out_dir: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    join_gloo_world(rank, world, init_file)
    results = {}
    for mesh_name, mesh, placements in (
            ("fsdp", init_device_mesh("cpu", (world,)), [Shard(0)]),
            ("hsdp", init_device_mesh("cpu", (1, world), mesh_dim_names=("replicate", "shard")),
             [Replicate(), Shard(0)])):
        model = lora_net()
        shards = {n: nn.Parameter(distribute_tensor(p.detach().clone(), mesh, placements))
                  for n, p in adapters(model).items()}
        opt = DistributedShampoo(list(shards.items()), preconditioner="riemannian_lora",
                                 weight_decay=0.01, **KEYWORDS)
        for step in range(STEPS):
            sharded_step(model, opt, shards, step)
        opt.consolidate_state_dict(to=0)
        result = {"params": [p.full_tensor().detach().clone() for p in shards.values()],
                  "owners": {r["name"]: r["rank"] for r in opt.describe_blocks()},
                  "kind": type(opt._distributor).__name__}
        if rank == 0:
            result["state_dict"] = opt.state_dict()
        results[mesh_name] = result
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    leave_gloo_world()  # together: a rank leaving early was seen to abort the other


def plain_optimizer(model):
    return DistributedShampoo(list(adapters(model).items()), preconditioner="riemannian_lora",
                              weight_decay=0.01, **KEYWORDS)


def test_fsdp2_and_hsdp_bit_identical_and_resume_from_the_consolidated_state():
    root = tempfile.mkdtemp(prefix="hf_shampoo_lora_fsdp_")
    with one_thread_per_process():
        mp.spawn(run_fsdp_world, args=(2, os.path.join(root, "init"), root), nprocs=2,
                 join=True)
    runs = [torch.load(os.path.join(root, f"rank{r}.pt"), weights_only=False)
            for r in range(2)]
    model = lora_net()
    opt = plain_optimizer(model)
    train(model, opt, STEPS)
    expected = [p.detach().clone() for p in adapters(model).values()]
    train(model, opt, 2, start=STEPS)
    for mesh_name in ("fsdp", "hsdp"):
        results = [run[mesh_name] for run in runs]
        for result in results:
            assert result["kind"] == "ShardedDistributor"
            assert_bitwise(result["params"], expected)
        owners = results[0]["owners"]
        assert any(adapter_side(n) and adapter_side(n)[0] == "A"
                   and owners[n] != owners[adapter_side(n)[1]] for n in owners), owners
        # the consolidated state resumes in one process as the one-process run goes on
        resumed_model = lora_net()
        with torch.no_grad():
            for p, q in zip(adapters(resumed_model).values(), results[0]["params"]):
                p.copy_(q)
        resumed = plain_optimizer(resumed_model)
        resumed.load_state_dict(results[0]["state_dict"])
        train(resumed_model, resumed, 2, start=STEPS)
        assert_bitwise([p.detach() for p in adapters(resumed_model).values()],
                       [p.detach() for p in adapters(model).values()])


def test_local_fsdp_mode_is_refused_on_every_rank():
    """fsdp_mode="local" blocks each rank's shard, which would cut r: refused (every rank
    raises alike, in the per-step hook)."""
    root = tempfile.mkdtemp(prefix="hf_shampoo_lora_local_")
    with one_thread_per_process():
        mp.spawn(run_local_world, args=(2, os.path.join(root, "init"), root), nprocs=2,
                 join=True)
    for r in range(2):
        error = torch.load(os.path.join(root, f"rank{r}.pt"), weights_only=False)
        assert "fsdp_mode='local'" in error, error


def run_local_world(rank: int, world: int, init_file: str, out_dir: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    join_gloo_world(rank, world, init_file)
    mesh = init_device_mesh("cpu", (world,))
    model = lora_net()
    shards = {n: nn.Parameter(distribute_tensor(p.detach().clone(), mesh, [Shard(0)]))
              for n, p in adapters(model).items()}
    opt = DistributedShampoo(list(shards.items()), preconditioner="riemannian_lora",
                             fsdp_mode="local", **KEYWORDS)
    error = ""
    try:
        sharded_step(model, opt, shards, 0)
    except NotImplementedError as e:
        error = str(e)
    torch.save(error, os.path.join(out_dir, f"rank{rank}.pt"))
    leave_gloo_world()  # together: a rank leaving early was seen to abort the other


# ------------------------------------------------------------------------- Trainer
def test_trainer_optim_args_and_exact_resume(tmp_path):
    transformers = pytest.importorskip("transformers")
    import hf_shampoo  # noqa: F401  (registers optim="distributed_shampoo")

    def model():
        torch.manual_seed(0)
        config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64,
                                         n_positions=16, bos_token_id=0, eos_token_id=0,
                                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        return peft.get_peft_model(
            transformers.GPT2LMHeadModel(config),
            peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn", "c_proj"],
                            fan_in_fan_out=True, lora_dropout=0.0))

    rows = torch.randint(0, 64, (16, 16), generator=torch.Generator().manual_seed(1))
    data = [{"input_ids": row, "labels": row} for row in rows]

    def trainer(out, m):
        args = transformers.TrainingArguments(
            output_dir=str(out), use_cpu=True, report_to=[], max_steps=4, save_steps=2,
            per_device_train_batch_size=4, learning_rate=1e-2, disable_tqdm=True,
            optim="distributed_shampoo",
            optim_args="*lora_*@preconditioner=riemannian_lora,*lora_*@epsilon=1e-6")
        return transformers.Trainer(model=m, args=args, train_dataset=data)

    whole = trainer(tmp_path / "a", model())
    whole.train()
    shampoo = getattr(whole.optimizer, "optimizer", whole.optimizer)
    kinds = {r["preconditioner"] for r in describe_rows(shampoo) if not r["frozen"]}
    assert kinds and all(k.startswith("riemannian_lora (lora_") for k in kinds)
    resumed = trainer(tmp_path / "b", model())
    resumed.train(resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-2"))
    assert_bitwise([p.detach() for p in adapters(resumed.model).values()],
                   [p.detach() for p in adapters(whole.model).values()])
