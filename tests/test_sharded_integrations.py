"""FSDP2 through Accelerate (2 gloo ranks), and every refused sharding (docs/design.md §8).

Accelerate runs its real FSDP2 code path (``prepare`` shards the model and swaps the
optimizer's parameters, bf16 ``MixedPrecisionPolicy``, gradient accumulation,
``clip_grad_norm_`` on DTensors, ``save_state`` / ``load_state`` with sharded and full
state dicts); see ``accelerate_fsdp_worker.py``. The refusals run in this process on a
one-rank gloo group.
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hf_shampoo import DistributedShampoo
from tests import accelerate_fsdp_worker as worker
from tests.helpers import (
    assert_trainer_resumed_exactly,
    one_thread_per_process,
    run_trainer_fsdp_worker,
)

pytestmark = pytest.mark.integrations


@pytest.fixture(scope="module")
def accelerate_runs():
    root = tempfile.mkdtemp(prefix="hf_shampoo_acc_fsdp_")
    with one_thread_per_process():
        mp.spawn(worker.run_world, args=(2, os.path.join(root, "init"), root), nprocs=2,
                 join=True)
    results = [torch.load(os.path.join(root, f"rank{r}.pt"), weights_only=False)
               for r in range(2)]
    errors = [r["error"] for r in results if "error" in r]
    assert not errors, errors[0]
    return results


@pytest.mark.parametrize("state_dict_type", ["SHARDED_STATE_DICT", "FULL_STATE_DICT"])
def test_accelerate_fsdp2_resume_is_exact(accelerate_runs, state_dict_type):
    for rank_result in accelerate_runs:
        run = rank_result[state_dict_type]
        assert run["kind"] == "ShardedDistributor"
        assert run["param_dtypes"] == ["torch.float32"]  # sharded params stay float32
        assert run["loaded_steps"] == [worker.SAVE_AT]
        for a, b in zip(run["saved"], run["loaded"]):
            assert torch.equal(a, b)
        for a, b in zip(run["resumed"], run["uninterrupted"]):
            assert torch.equal(a, b), (a - b).abs().max()
    first = accelerate_runs[0][state_dict_type]["uninterrupted"]
    for a, b in zip(accelerate_runs[1][state_dict_type]["uninterrupted"], first):
        assert torch.equal(a, b)


def test_trainer_fsdp2_resume_is_exact(tmp_path):
    """The Trainer's own FSDP2 path (sharded state dict; a full one fails on a CPU in
    safetensors' model save, before the optimizer is reached)."""
    result = run_trainer_fsdp_worker(tmp_path, "SHARDED_STATE_DICT", nproc=2)
    assert_trainer_resumed_exactly(result)


# ----------------------------------------------------------------- refusals
@pytest.fixture()
def one_rank_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0,
                            world_size=1)
    yield
    dist.destroy_process_group()


def _dtensor(shape, placements, mesh_shape=(1,), names=None):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    return torch.nn.Parameter(distribute_tensor(torch.randn(shape), mesh, placements))


def _no_state(opt: DistributedShampoo) -> bool:
    return opt._layout is None or not any(s.state for s in opt._layout.stacks)


def test_partial_placement_is_refused_before_any_state(one_rank_group):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial

    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
    param = torch.nn.Parameter(DTensor.from_local(torch.randn(4, 6), mesh, [Partial()]))
    with pytest.raises(ValueError, match=r"parameter 0 \(shape \(4, 6\)\) is a DTensor placed "
                                         r"\(Partial\(sum\),\).*partial sums"):
        DistributedShampoo([param])


def test_a_partial_gradient_is_read_summed_and_left_as_it_is(one_rank_group):
    """A gradient left as a ``Partial`` sum (a tensor-parallel backward) is redistributed
    to its parameter's placements for the step, into a tensor of the step's own: ``p.grad``
    stays the same tensor, placements, version and values, and the step equals one given
    the summed gradient."""
    from torch.distributed.tensor import DTensor, Partial, Replicate

    params = [_dtensor((6, 4), [Replicate()]) for _ in range(2)]
    params[1].data.copy_(params[0].data)
    gen = torch.Generator().manual_seed(0)
    opts = [DistributedShampoo([p], lr=0.1, grafting="adam", precondition_frequency=2,
                               start_preconditioning_step=2) for p in params]
    for _ in range(3):
        local = torch.randn(6, 4, generator=gen)
        mesh = params[0].device_mesh
        partial = DTensor.from_local(local.clone(), mesh, [Partial()])
        params[0].grad = partial
        params[1].grad = DTensor.from_local(local.clone(), mesh, [Replicate()])
        version = partial._version
        for opt in opts:
            opt.step()
        assert params[0].grad is partial and partial.placements == (Partial(),)
        assert partial._version == version and torch.equal(partial.to_local(), local)
    assert torch.equal(params[0].to_local(), params[1].to_local())


def test_local_mode_refuses_tensor_parallel_placements(one_rank_group):
    from torch.distributed.tensor import Shard

    param = _dtensor((4, 6), [Shard(0), Shard(1)], (1, 1), ("dp", "tp"))
    with pytest.raises(ValueError, match="fsdp_mode='local'.*fsdp_mode='lossless'"):
        opt = DistributedShampoo([param], fsdp_mode="local")
        param.grad = torch.zeros_like(param)
        opt.step()


def test_fsdp1_flat_parameter_is_refused():
    param = torch.nn.Parameter(torch.randn(10))
    param._fsdp_flattened = True  # what FSDP1 marks its flat (and use_orig_params) params with
    with pytest.raises(ValueError, match="FSDP1.*fully_shard"):
        DistributedShampoo([param])


def test_deepspeed_zero_parameter_is_refused():
    param = torch.nn.Parameter(torch.randn(10))
    param.ds_id = 3
    with pytest.raises(ValueError, match="DeepSpeed ZeRO stage 3.*stage 1 or 2.*FSDP2"):
        DistributedShampoo([param])


def test_fsdp_mode_without_sharded_parameters_is_refused_at_the_first_step():
    param = torch.nn.Parameter(torch.randn(4, 3))
    opt = DistributedShampoo([param], distributed="fsdp")  # Accelerate may shard later
    param.grad = torch.randn(4, 3)
    before = param.detach().clone()
    with pytest.raises(ValueError, match="distributed='fsdp' needs parameters sharded"):
        opt.step()
    assert torch.equal(param.detach(), before) and _no_state(opt)


def test_ddp_and_none_refuse_dtensors(one_rank_group):
    from torch.distributed.tensor import Shard

    for mode in ("ddp", "none"):
        with pytest.raises(ValueError, match="use distributed='auto' or 'fsdp'"):
            DistributedShampoo([_dtensor((4, 3), [Shard(0)])], distributed=mode)


def test_trainer_groups_are_refused_with_fsdp(one_rank_group):
    from torch.distributed.tensor import Shard

    with pytest.raises(ValueError, match="num_trainers_per_group=2 applies to data-parallel"):
        DistributedShampoo([_dtensor((4, 3), [Shard(0)])], num_trainers_per_group=2)


def test_bad_fsdp_mode_is_refused():
    with pytest.raises(ValueError, match="fsdp_mode='sharded'.*'lossless', 'local'"):
        DistributedShampoo([torch.nn.Parameter(torch.randn(3))], fsdp_mode="sharded")


@pytest.mark.parametrize("placement", ["Shard(0)", "Shard(1)", "Replicate()"])
def test_one_rank_mesh_is_one_process(one_rank_group, placement):
    """A 1-rank FSDP2 or tensor-parallel mesh: the sharded path, bit-identical to plain
    tensors."""
    from torch.distributed.tensor import Replicate, Shard

    torch.manual_seed(0)
    full = [torch.randn(6, 5), torch.randn(7, 3)]
    where = {"Shard(0)": Shard(0), "Shard(1)": Shard(1), "Replicate()": Replicate()}[placement]
    sharded = [_dtensor(t.shape, [where]) for t in full]
    for p, t in zip(sharded, full):
        p.data.to_local().copy_(t)
    plain = [torch.nn.Parameter(t.clone()) for t in full]
    config = dict(lr=0.1, grafting="adam", precondition_frequency=2, max_preconditioner_dim=4)
    a, b = DistributedShampoo(sharded, **config), DistributedShampoo(plain, **config)
    for step in range(4):
        g = torch.Generator().manual_seed(step)
        grads = [torch.randn(t.shape, generator=g) for t in full]
        from torch.distributed.tensor import distribute_tensor
        for p, q, grad in zip(sharded, plain, grads):
            p.grad = distribute_tensor(grad, p.device_mesh, p.placements)
            q.grad = grad
        a.step()
        b.step()
    assert type(a._distributor).__name__ == "ShardedDistributor"
    for p, q in zip(sharded, plain):
        assert torch.equal(p.full_tensor(), q.detach())
