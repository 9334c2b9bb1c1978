"""Shared helpers of the tests: the test device, deterministic gradients, an optimizer-vs-reference
runner, a command run in this checkout (``run``), the torchrun launchers, the Trainer FSDP2
worker's launch and its checks. Test modules import helpers from here (or from the other
non-test modules of tests/: ``tiny_trainer``, ``package_modules``, the workers), never from
another test module."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.reference_shampoo import ReferenceShampoo

F64 = torch.float64


def _test_device() -> torch.device:
    name = os.environ.get("HF_SHAMPOO_TEST_DEVICE", "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise ValueError(f"HF_SHAMPOO_TEST_DEVICE={name!r}: expected 'cpu', 'cuda' or 'cuda:N'")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"HF_SHAMPOO_TEST_DEVICE={name!r}, but torch sees no CUDA device")
    return device


TEST_DEVICE = _test_device()  # tests/conftest.py: which tests run there


# On CUDA, cuBLAS's float32 products (and QR, Cholesky) give a matrix other bits in a batch
# than alone (benchmarks/batch_invariance.py, an H200: docs/gpu.md#bit-identity), so a test
# that a block's bits do not depend on the other blocks of its stack holds on the CPU only.
cpu_batch_invariance = pytest.mark.skipif(
    TEST_DEVICE.type != "cpu",
    reason="batched products on this device round by batch (docs/gpu.md#bit-identity)")


def generator(seed: int) -> torch.Generator:
    """A seeded generator on the test device (the same numbers as before on CPU)."""
    return torch.Generator(device=TEST_DEVICE).manual_seed(seed)


def train_mse(model, opt, steps: int, seed: int = 0, batch: int = 8, features: int = 6,
              targets: int = 3) -> None:
    """``steps`` steps of ``opt`` on ``model``'s mean squared error, each on a random batch
    (``batch`` rows of ``features`` inputs and ``targets`` outputs) from ``generator(seed)``."""
    gen = generator(seed)
    for _ in range(steps):
        x = torch.randn(batch, features, generator=gen)
        y = torch.randn(batch, targets, generator=gen)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def random_tensors(shape, count, seed, scale=1.0):
    """``count`` float64 tensors drawn on the CPU and moved to the test device: every
    device sees the numbers the cases were chosen with (CUDA's generator draws others,
    and the reference-equality cases that must cross a tolerance then did not, on an H200)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    return [(scale * torch.randn(shape, generator=gen, dtype=F64, device="cpu")).to(TEST_DEVICE)
            for _ in range(count)]


def run_against_reference(
    shape,
    config,
    steps=6,
    seed=0,
    grads=None,
    lrs=None,
    rtol=1e-9,
    atol=1e-12,
    ours_only=(),
    reference_changes=None,
):
    """Step the optimizer and the reference on the same gradients; compare after every step.
    Keys of ``config`` named in ``ours_only`` go to the optimizer only (how, not what, it
    computes: e.g. its root solver); ``reference_changes`` replace keys for the reference
    (a kind that computes the same numbers another way).

    Returns the reference so that callers can look at its counters.
    """
    from hf_shampoo import DistributedShampoo

    (w0,) = random_tensors(shape, 1, seed + 1000)
    if grads is None:
        grads = random_tensors(shape, steps, seed)
    param = torch.nn.Parameter(w0.clone())
    opt = DistributedShampoo([param], factor_matrix_dtype=F64, **config)
    ref = ReferenceShampoo(w0, **{**{k: v for k, v in config.items() if k not in ours_only},
                                  **(reference_changes or {})})
    for t, g in enumerate(grads, start=1):
        lr = None
        if lrs is not None:
            lr = lrs[t - 1]
            opt.param_groups[0]["lr"] = lr
        param.grad = None if g is None else g.clone()
        opt.step()
        ref.step(g, lr=lr)
        torch.testing.assert_close(
            param.detach(),
            ref.param,
            rtol=rtol,
            atol=atol,
            msg=lambda m, t=t: f"after step {t}: {m}",
        )
    # the parameter moved at all (guards against a test that compares two no-ops)
    assert not torch.equal(param.detach(), w0)
    return ref


ROOT = Path(__file__).resolve().parents[1]


def launcher_env(**env_extra: str) -> dict[str, str]:
    """The environment of a test's launcher: no rank variables another test may have left,
    one thread per rank, this checkout first on the path (not whichever copy the
    environment installed), and ``env_extra``."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                        "MASTER_PORT", "GROUP_RANK") and not k.startswith("ACCELERATE_")}
    env.update(OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])),
               **env_extra)
    return env


def torchrun(script: str, args: list[str], nproc: int, timeout: int = 300,
             **env_extra: str) -> None:
    """``tests/<script> args`` under ``torchrun --nproc_per_node nproc`` in a fresh
    environment (``launcher_env``); fails the test with the output's tail unless every
    rank succeeds."""
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc_per_node", str(nproc), str(ROOT / "tests" / script), *args],
                          cwd=ROOT, env=launcher_env(**env_extra), timeout=timeout,
                          capture_output=True, text=True)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]


def run(cmd: list[str], timeout: float = 180, cwd: Path | None = None) -> str:
    """``cmd`` in this checkout (one thread, this checkout first on the path); fails the
    test with the output's tail unless it succeeds, else returns its stdout and stderr."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    done = subprocess.run(
        cmd, cwd=cwd or ROOT, env=env, capture_output=True, text=True, timeout=timeout,
        check=False,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-6000:]
    return output


def free_port() -> int:
    """A TCP port of 127.0.0.1 that nothing listens on now (the kernel's pick)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def torchrun_nodes(script: str, args: list[str], nnodes: int, nproc: int, log_dir,
                   rendezvous: str = "c10d", timeout: int = 300) -> None:
    """``tests/<script> args`` on ``nnodes`` simulated machines: one ``torchrun --nnodes
    nnodes --nproc_per_node nproc`` per node R, all at once on this machine, meeting on
    127.0.0.1 through the ``c10d`` rendezvous (a fresh port and ``--rdzv-id``; torch
    numbers the nodes itself) or the ``static`` one (``--node-rank R --master-addr
    --master-port``; ``GROUP_RANK`` is then R). Each launcher's workers see
    ``HF_SHAMPOO_TEST_NODE=R``, its output goes to ``log_dir/node{R}.log``. Fails the
    test with the logs' tails unless every launcher succeeds in ``timeout`` seconds; once
    one fails or time is up, the others are killed with their workers."""
    import signal
    import time
    import uuid

    port, log_dir = free_port(), Path(log_dir)
    if rendezvous == "c10d":
        meet = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
                "--rdzv-id", uuid.uuid4().hex]
    else:
        meet = ["--rdzv-backend", "static", "--master-addr", "127.0.0.1",
                "--master-port", str(port)]
    launchers, logs = [], []
    for node in range(nnodes):
        logs.append(log_dir / f"node{node}.log")
        node_rank = ["--node-rank", str(node)] if rendezvous == "static" else []
        with open(logs[-1], "w") as log:
            launchers.append(subprocess.Popen(
                [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nnodes),
                 *node_rank, "--nproc_per_node", str(nproc), *meet,
                 "--local-addr", "127.0.0.1", str(ROOT / "tests" / script), *args],
                cwd=ROOT, env=launcher_env(HF_SHAMPOO_TEST_NODE=str(node)), stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True))
    deadline, codes = time.monotonic() + timeout, [None] * nnodes
    try:  # until all succeed, one fails (the others would wait for it) or time is up
        while None in codes and not any(codes) and time.monotonic() < deadline:
            time.sleep(0.2)
            codes = [launcher.poll() for launcher in launchers]
    finally:
        for launcher in launchers:  # each launcher with its workers (its own session)
            if launcher.poll() is None:
                os.killpg(launcher.pid, signal.SIGKILL)
                launcher.wait()
    tails = "\n".join(f"--- node {node} ({log.name}):\n{log.read_text()[-3000:]}"
                      for node, log in enumerate(logs))
    assert any(codes) or None not in codes, f"not done after {timeout} s\n{tails}"
    assert codes == [0] * nnodes, f"exit codes {codes} (None: killed)\n{tails}"


def join_gloo_world(rank: int, world: int, init_file: str) -> None:
    """What an ``mp.spawn``ed test rank does first: one thread, the rank variables
    Accelerate and the Trainer read, a gloo group through ``init_file``."""
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="0", RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world))
    torch.distributed.init_process_group("gloo", init_method=f"file://{init_file}",
                                         rank=rank, world_size=world)


def leave_gloo_world(barrier: bool = True) -> None:
    """What a spawned test rank does last, after writing its results: wait for the others
    (unless ``barrier=False``: a worker whose ranks may stop at different points), destroy
    the groups, and exit at once. Interpreter finalization is skipped: ranks that had
    written their results were aborted there under load ("terminate called without an
    active exception", gloo's threads at exit; tests/test_metrics.py and
    tests/test_moe_experts.py in CI runs), which fails a test although nothing in it
    failed."""
    if barrier:
        torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def assert_bitwise(got, expected) -> None:
    """The same number of tensors, each equal bit for bit (the largest difference shown)."""
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        assert torch.equal(a, b), (a.float() - b.float()).abs().max()


# scenarios whose communication rounds, and how close to one process they stay: bf16 rounds
# each update to 8 bits of mantissa; with float64 factors the float64 update travels (and
# is applied) as float32, as under DDP
ROUNDED_COMMUNICATION = (("bf16_communication", 5e-4), ("compute_cost_f64", 1e-6))


def exact_scenarios(scenarios) -> list[str]:
    """The scenarios whose distributed runs equal one process's bit for bit: all but
    ``ROUNDED_COMMUNICATION``'s."""
    return [name for name in scenarios if name not in dict(ROUNDED_COMMUNICATION)]


def assert_sharded_ranks_bitwise(rank_results, scenario: str, expected) -> None:
    """Every rank ran ``scenario`` with the sharded distributor, and its parameters equal
    ``expected`` (one process's) bit for bit."""
    for rank_result in rank_results:
        assert rank_result[scenario]["kind"] == "ShardedDistributor"
        assert_bitwise(rank_result[scenario]["params"], expected)


def assert_rounded_runs_close_and_identical(rank_results, one_process) -> None:
    """For each scenario of ``ROUNDED_COMMUNICATION``: every rank's parameters within its
    tolerance of ``one_process(scenario)``'s, and equal across ranks bit for bit."""
    for scenario, atol in ROUNDED_COMMUNICATION:
        expected = one_process(scenario)
        first = rank_results[0][scenario]["params"]
        for rank_result in rank_results:
            got = rank_result[scenario]["params"]
            for a, b in zip(got, expected):
                torch.testing.assert_close(a, b, rtol=0, atol=atol)
            assert_bitwise(got, first)


def run_trainer_fsdp_worker(out_dir, state_dict_type: str, nproc: int, device: str = "cpu",
                            timeout: int = 300) -> dict:
    """``tests/trainer_fsdp_worker.py`` under ``torchrun`` (``torchrun``); the result it
    wrote."""
    torchrun("trainer_fsdp_worker.py", [str(out_dir), state_dict_type, device], nproc,
             timeout)
    return json.loads((Path(out_dir) / f"result_{state_dict_type}.json").read_text())


def assert_trainer_resumed_exactly(result: dict) -> None:
    """The worker's run saved at step 4 and resumed matches the uninterrupted one, bit for
    bit, with the optimizer sharded (DTensor parameters), and it trained."""
    assert result["distributor"] == "ShardedDistributor"
    assert result["dtensor_params"] > 0
    for step in ("5", "6", "7", "8"):  # the resumed steps, bit for bit
        assert result["losses_b"][step] == result["losses_a"][step]
    assert result["losses_a"]["8"] < result["losses_a"]["1"]
    assert result["params_equal"]


@contextlib.contextmanager
def one_thread_per_process():
    """``OMP_NUM_THREADS=1`` for processes spawned inside (several ranks on 2 cores run
    10-20x slower oversubscribed), restored afterwards."""
    previous = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("OMP_NUM_THREADS")
        else:
            os.environ["OMP_NUM_THREADS"] = previous


@contextlib.contextmanager
def torch_threads(count: int):
    """torch's intra-op thread count set to ``count`` inside, restored afterwards (bit
    identity across stacks holds at one thread per process: docs/design.md §13)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def assert_resumes_exactly(make_model, make_optimizer, train) -> dict:
    """Train 3 steps, save model and optimizer through torch.save, train 3 more; a fresh
    model and optimizer loaded from the file and trained the same 3 steps must end bit for
    bit where the first run did. ``train(model, optimizer, steps, seed)``. Returns the saved
    optimizer state (for further checks)."""
    import io

    model = make_model()
    optimizer = make_optimizer(model)
    train(model, optimizer, 3, 0)
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, buffer)
    train(model, optimizer, 3, 1)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    resumed = make_model()
    resumed.load_state_dict(saved["model"])
    again = make_optimizer(resumed)
    again.load_state_dict(saved["optimizer"])
    train(resumed, again, 3, 1)
    for a, b in zip(model.parameters(), resumed.parameters()):
        assert torch.equal(a.detach(), b.detach())
    return saved["optimizer"]
