"""``refresh_delay``: a refresh computed from a snapshot of its step and used ``d`` steps
later, off the critical path (hf_shampoo/delayed_refresh.py, docs/performance.md).

What a user relies on: the background run equals the same delayed result computed at once,
bit for bit, for every kind that refreshes and both schedules; the roots used from step
``t + d`` are those of step ``t``'s factors (a dense float64 formula) and the steps between
keep the previous ones; a save with a refresh pending resumes exactly (``state_dict``,
``deepcopy``, DCP; the Trainer in tests/test_integration_transformers.py), and only
checkpoints hold pending results; a block grafts until its first roots arrive; a
decomposition that fails in the background is reported on the step that applies it; bad
values are refused; no worker thread outlives its optimizer. Device-generic
(``HF_SHAMPOO_TEST_DEVICE=cuda``: the side stream); without a GPU the CUDA branch runs
against a log of CUDA's stream API, which checks the order of its events and streams.
Distributed layouts draw ``refresh_delay`` in tests/test_generated_*layouts.py.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import threading
import warnings

import pytest
import torch

from hf_shampoo import DistributedShampoo
from hf_shampoo.errors import ShampooNumericalError
from tests.helpers import TEST_DEVICE, generator

pytestmark = [pytest.mark.unit, pytest.mark.device]

SHAPES = [(6, 5), (6, 5), (7,), (4, 3, 2), (9, 4)]

KINDS = {
    "shampoo": dict(grafting="adam", epsilon=1e-8),
    "shampoo_qr_tolerance": dict(grafting="adam", epsilon=1e-8, eigendecomposition="qr",
                                 eigenbasis_tolerance=0.05, qr_max_iterations=3),
    "shampoo_coupled_newton": dict(grafting="adam", epsilon=1e-6,
                                   root_inverse="coupled_newton"),
    "soap": dict(preconditioner="eigenvalue_corrected", epsilon=1e-8),
    "soap_descending_qr": dict(preconditioner="eigenvalue_corrected", epsilon=1e-8,
                               eigenbasis_variant="descending", eigendecomposition="qr"),
    "kl_shampoo": dict(preconditioner="kl_shampoo", grafting="adam", epsilon=1e-8),
    "eigendecomposed": dict(preconditioner="eigendecomposed_shampoo", grafting="adam",
                            epsilon=1e-8),
    "sketchy": dict(preconditioner="sketchy", grafting="adam", epsilon=1e-7,
                    sketch_rank=2, sketch_threshold=5),
}


def params(seed: int = 0) -> list[torch.nn.Parameter]:
    g = generator(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in SHAPES]


def make(ps, delay: int, background: bool = True, **kw) -> DistributedShampoo:
    settings = dict(lr=0.02, precondition_frequency=4, distributed="none",
                    max_preconditioner_dim=8) | kw
    opt = DistributedShampoo(ps, refresh_delay=delay, **settings)
    opt.background_refresh = background
    return opt


def gradients(steps: int, seed: int = 1) -> list[list[torch.Tensor]]:
    g = generator(seed)
    return [[torch.randn(s, generator=g) for s in SHAPES] for _ in range(steps)]


def train(delay: int, kw: dict, steps: int = 13, background: bool = True,
          resume_at: int | None = None, via: str = "state_dict",
          directory=None, resume_delay: int | None = None) -> list[torch.Tensor]:
    """``resume_delay``: the ``refresh_delay`` the optimizer that loads is built with (the
    checkpoint's is taken)."""
    ps = params()
    opt = make(ps, delay, background, **kw)
    resumed = delay if resume_delay is None else resume_delay
    for t, grads in enumerate(gradients(steps), start=1):
        for p, g in zip(ps, grads):
            p.grad = g.clone()
        opt.step()
        if t == resume_at:
            if via == "deepcopy":
                copied = copy.deepcopy((ps, opt))
                ps, opt = copied
            elif via == "dcp":  # torch.distributed.checkpoint, one process
                from hf_shampoo.checkpoint import load_sharded, save_sharded

                where = directory / f"at{t}"
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # "assuming ... a single process"
                    save_sharded(opt, where)
                    ps = [torch.nn.Parameter(p.detach().clone()) for p in ps]
                    opt = make(ps, resumed, background, **kw)
                    load_sharded(opt, where)
            else:
                saved = copy.deepcopy(opt.state_dict())
                ps = [torch.nn.Parameter(p.detach().clone()) for p in ps]
                opt = make(ps, resumed, background, **kw)
                opt.load_state_dict(saved)
                assert [g["refresh_delay"] for g in opt.param_groups] == [delay]
    return [p.detach().clone() for p in ps]


def assert_identical(a, b):
    for x, y in zip(a, b):
        assert torch.equal(x, y), (x - y).abs().max()


@pytest.mark.parametrize("schedule", ["all", "staggered"])
@pytest.mark.parametrize("name", sorted(KINDS))
def test_background_equals_the_delayed_result_computed_at_once(name, schedule):
    kw = KINDS[name] | {"refresh_schedule": schedule}
    for delay in (1, 4):
        background = train(delay, kw)
        assert_identical(background, train(delay, kw, background=False))
    # and a delay changes the trajectory (the test would see a delay that did nothing)
    assert not all(torch.equal(x, y) for x, y in zip(background, train(0, kw)))


@pytest.mark.parametrize("via", ["state_dict", "deepcopy", "dcp"])
@pytest.mark.parametrize("name", ["shampoo", "soap_descending_qr", "sketchy"])
def test_a_save_with_a_refresh_pending_resumes_exactly(name, via, tmp_path):
    if via == "dcp" and TEST_DEVICE.type != "cpu":
        pytest.skip("torch.distributed.checkpoint without a process group: on the CPU")
    kw = KINDS[name] | {"refresh_schedule": "staggered"}
    reference = train(3, kw)
    for at in (4, 5, 6, 9):  # pending refreshes of the first and of later rounds
        assert_identical(reference, train(3, kw, resume_at=at, via=via, directory=tmp_path))


@pytest.mark.parametrize("via", ["state_dict", "dcp"])
@pytest.mark.parametrize("saved, built", [(0, 3), (3, 0), (3, 1)])
def test_a_checkpoint_resumes_with_its_own_delay(saved, built, via, tmp_path):
    """A checkpoint saved with one ``refresh_delay`` (0: Meta's, and the defaults before
    ``make_optimizer`` and the Trainer took 1) loaded into an optimizer built with another
    takes the saved one, as torch loads a saved lr, and the resumed run is the
    uninterrupted one, bit for bit, also with refreshes pending at the save."""
    if via == "dcp" and TEST_DEVICE.type != "cpu":
        pytest.skip("torch.distributed.checkpoint without a process group: on the CPU")
    kw = KINDS["shampoo"] | {"refresh_schedule": "staggered"}
    reference = train(saved, kw)
    for at in (5, 6):
        assert_identical(reference, train(saved, kw, resume_at=at, via=via,
                                          directory=tmp_path / f"{at}", resume_delay=built))


def test_pending_results_are_held_by_checkpoints_not_by_the_state():
    """Between steps a delayed optimizer keeps, of its refreshes, only the step each
    block's pending result applies at (no second copy of the roots); a state dict taken
    with refreshes pending has a ``pending_`` entry for every block (the same keys and
    shapes whatever is in flight, as torch.distributed.checkpoint needs), and a pending
    block's entry is the root the optimizer uses from its due step on."""
    ps = params()
    opt = make(ps, 3, grafting="adam", epsilon=1e-8, refresh_schedule="staggered")
    steps = gradients(13)
    for grads in steps[:5]:  # refreshes pending now: due at steps 7 and 8 (f = 4, d = 3)
        for p, g in zip(ps, grads):
            p.grad = g.clone()
        opt.step()
    for p in ps:
        assert not [k for k in opt.state[p] if "pending_" in k]
        assert [k for k in opt.state[p] if k.endswith(".refresh_due_step")]
    saved = opt.state_dict()
    pending = {}
    for index, entry in saved["state"].items():
        blocks = {k.split(".")[0] for k in entry}
        for block in blocks:
            names = {k.split(".", 1)[1] for k in entry if k.startswith(block + ".")}
            roots = {n for n in names if n.startswith("inverse_root_")}
            assert roots and {"pending_" + n for n in roots} <= names, (index, block)
            for n in roots:
                assert entry[f"{block}.pending_{n}"].shape == entry[f"{block}.{n}"].shape
            due = int(entry[f"{block}.refresh_due_step"])
            if due > 5:
                pending[(index, block)] = (due, {n: entry[f"{block}.pending_{n}"].clone()
                                                 for n in roots})
    assert pending, "no refresh was pending at the save"
    for t, grads in enumerate(steps[5:], start=6):
        for p, g in zip(ps, grads):
            p.grad = g.clone()
        opt.step()
        for (index, block), (due, roots) in pending.items():
            if due == t:
                for n, root in roots.items():
                    assert torch.equal(opt.state[ps[index]][f"{block}.{n}"], root)
    assert max(due for due, _ in pending.values()) <= 13


def test_roots_are_the_factors_of_the_refresh_step_and_apply_d_steps_later():
    """Shampoo, "all" schedule, f = 4, d = 2: after step t + d the root of each block is
    ``(F_t / (1 - β2^t) + εI)^(-1/2k)`` in float64 (F_t: its factor after step t); after the
    steps in between it is still the previous one."""
    ps = params()
    beta2, epsilon, delay = 0.99, 1e-6, 2
    opt = make(ps, delay, betas=(0.9, beta2), epsilon=epsilon, grafting="adam")
    factors, roots = {}, {}
    for t, grads in enumerate(gradients(13), start=1):
        for p, g in zip(ps, grads):
            p.grad = g.clone()
        opt.step()
        state = opt.state[ps[0]]
        factors[t] = state["block_0.factor_matrix_0"].double().clone()
        roots[t] = state["block_0.inverse_root_0"].double().clone()
    for t in (4, 8):  # refresh steps; the first one at the start step
        f = factors[t] / (1 - beta2**t) + epsilon * torch.eye(6, dtype=torch.float64)
        lam, q = torch.linalg.eigh(f)
        expected = q @ torch.diag(lam ** (-1 / 4)) @ q.T
        torch.testing.assert_close(roots[t + delay], expected, rtol=2e-4, atol=2e-5)
        for between in range(t, t + delay):
            assert torch.equal(roots[between], roots[t - 1])


def test_a_block_grafts_until_its_first_roots_arrive():
    """Before its first roots apply (start step + d), a block's step is the grafting
    method's: the same bits as a run that has not started preconditioning."""
    kw = dict(grafting="adam", epsilon=1e-8)
    delayed = train(3, kw, steps=6)  # start 4: roots from step 7 on
    grafting_only = train(0, kw | {"start_preconditioning_step": 100}, steps=6)
    assert_identical(delayed, grafting_only)
    started = train(0, kw | {"start_preconditioning_step": 100}, steps=7)
    assert not all(torch.equal(x, y) for x, y in zip(train(3, kw, steps=7), started))


def test_a_failure_in_the_background_is_reported_on_the_step_that_applies_it(monkeypatch):
    from hf_shampoo import linalg

    real = linalg.batched_eigh_many

    def failing(inputs, memory=None):
        out = real(inputs, memory)
        for e in out:
            e.ok = [False] * len(e.ok)
        return out

    monkeypatch.setattr(linalg, "batched_eigh_many", failing)
    ps = params()
    opt = make(ps, 2, grafting="adam", epsilon=1e-8)
    warned_at = []
    for t, grads in enumerate(gradients(13), start=1):
        for p, g in zip(ps, grads):
            p.grad = g.clone()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                opt.step()
            except ShampooNumericalError as error:
                assert "failed at step" in str(error)
                warned_at.append(("raised", t))
                break
        if any("keeping the previous preconditioner" in str(w.message) for w in caught):
            warned_at.append(("warned", t))
    # refreshes at 4, 8, 12 apply at 6, 10, 14; the fourth failure in a row raises
    assert warned_at[:2] == [("warned", 6), ("warned", 10)]


def test_bad_values_are_refused_before_anything_changes():
    ps = params()
    with pytest.raises(ValueError, match=r"refresh_delay.*\[0, 4\]"):
        make(ps, 5)
    with pytest.raises(ValueError, match=r"refresh_delay.*\[0, 1\]"):
        make(ps, 2, start_preconditioning_step=7)  # refreshes at 7, then 8
    with pytest.raises(ValueError, match=r"refresh_delay.*4bit"):
        make(ps, 1, quantization="4bit")
    with pytest.raises(ValueError, match="refresh_delay"):
        make(ps, -1)


def _workers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("hf_shampoo_refresh")]


def test_no_worker_thread_outlives_its_optimizer():
    gc.collect()  # the optimizers of earlier tests (in reference cycles) and their threads
    for thread in _workers():
        thread.join(timeout=10)
    before = set(_workers())
    train(2, KINDS["shampoo"], steps=6)
    gc.collect()  # told to end, not waited for: each ends by itself
    for thread in set(_workers()) - before:
        thread.join(timeout=10)
    assert set(_workers()) <= before


def test_collecting_an_optimizer_never_waits_for_its_worker():
    """The garbage collector may finalize an optimizer inside ``threading``'s critical
    sections (a thread being started holds ``_shutdown_locks_lock``, which a join takes):
    collecting one there must not join its worker. Once that join hung a rank."""
    opt = DistributedShampoo([torch.nn.Parameter(torch.randn(6, 5, generator=generator(0)))],
                             lr=0.01, precondition_frequency=2, start_preconditioning_step=2,
                             refresh_delay=1, distributed="none")
    for _ in range(3):
        for p in opt.param_groups[0]["params"]:
            p.grad = torch.randn(p.shape, generator=generator(1))
        opt.step()
    assert _workers()
    del opt, p
    collector = threading.Thread(target=gc.collect, daemon=True)  # starts without the lock
    with threading._shutdown_locks_lock:  # what a starting thread holds
        collector.start()
        collector.join(timeout=20)
        stuck = collector.is_alive()
    collector.join()
    assert not stuck, "collecting the optimizer waited for its worker thread"


def test_the_worker_leaves_the_thread_count_alone(monkeypatch):
    """torch.set_num_threads from any thread sets the count of the whole process: the
    worker must not call it (the training thread's operators would change their count, and
    perhaps their bits, with the timing of the refreshes)."""
    calls = []
    real = torch.set_num_threads

    def recording(n):
        calls.append(threading.current_thread().name)
        real(n)

    monkeypatch.setattr(torch, "set_num_threads", recording)
    before = torch.get_num_threads()
    try:
        real(2)
        train(2, KINDS["shampoo_qr_tolerance"], steps=9)
        train(2, KINDS["soap"], steps=9)
    finally:
        real(before)
    assert not [name for name in calls if name.startswith("hf_shampoo_refresh")]


class _LoggedCuda:
    """CUDA's stream API as a log (no GPU needed): each thread's current stream, events
    recorded and waited for, ``record_stream`` calls, and where ``compute`` ran."""

    class Stream:
        def __init__(self, name: str, log: list) -> None:
            self.name, self._log = name, log

        def wait_event(self, event) -> None:
            self._log.append(("wait", self.name, event.name))

    class Event:
        def __init__(self, name: str, log: list) -> None:
            self.name, self._log = name, log

        def record(self, stream) -> None:
            self._log.append(("record", self.name, stream.name))

    def __init__(self) -> None:
        self.log: list[tuple] = []
        self.main = self.Stream("main", self.log)
        self._current = threading.local()
        self._events = 0

    def current(self, device=None):
        return getattr(self._current, "stream", self.main)

    def event(self):
        self._events += 1
        return self.Event(f"event{self._events}", self.log)

    @contextlib.contextmanager
    def stream(self, stream):
        self._current.stream = stream
        try:
            yield
        finally:
            del self._current.stream

    def install(self, monkeypatch) -> None:
        log = self.log
        monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: self.Stream("side", log))
        monkeypatch.setattr(torch.cuda, "Event", self.event)
        monkeypatch.setattr(torch.cuda, "current_stream", self.current)
        monkeypatch.setattr(torch.cuda, "stream", self.stream)
        monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
        monkeypatch.setattr(torch.Tensor, "record_stream", lambda tensor, stream: log.append(
            ("record_stream", tensor.data_ptr(), stream.name)), raising=False)


@pytest.mark.skipif(TEST_DEVICE.type == "cuda", reason="on a GPU the real side stream runs")
def test_the_cuda_path_orders_its_streams(monkeypatch):
    """Without a GPU, the CUDA branch of the worker run against a log of CUDA's stream
    API: the side stream waits for the snapshot's event before the refresh computes on it,
    in the worker thread; the step's stream waits for the side stream's event before the
    results are used; the snapshot is kept for the side stream, the results and the
    tensors the reports carry for the step's stream (``record_stream``), so the allocator
    reuses none of them too early."""
    from hf_shampoo import delayed_refresh
    from hf_shampoo.delayed_refresh import Pending, Refresher, _result

    cuda = _LoggedCuda()
    cuda.install(monkeypatch)
    snapshot, out = torch.ones(3), torch.zeros(3)
    flags, values = torch.ones(1, dtype=torch.bool), torch.full((1, 3), 2.0)
    host_flags = torch.ones(1, dtype=torch.bool)  # a kind that moved its flags to the host
    reports = [("count_failures", ("factor_matrix_0", flags, [0], 2), {"eigenvalues": values}),
               ("count_failures", ("factor_matrix_1", host_flags, [0], 2), {})]
    monkeypatch.setattr(delayed_refresh, "_on_cuda", lambda tensor: tensor is not host_flags)
    where = []

    def compute():
        where.append(threading.current_thread().name)
        cuda.log.append(("compute", cuda.current().name))
        return {"inverse_root_0": out}, reports

    refresher = Refresher(background=True)
    future = refresher.submit(compute, torch.device("cuda", 0), [snapshot])
    result, calls = _result(Pending(2, [0], future), torch.device("cuda", 0))
    assert result["inverse_root_0"] is out and calls is reports
    assert where and where[0].startswith("hf_shampoo_refresh")
    assert cuda.log == [
        ("record", "event1", "main"),  # the snapshot is ready on the step's stream
        ("record_stream", snapshot.data_ptr(), "side"),
        ("wait", "side", "event1"),
        ("compute", "side"),
        ("record", "event2", "side"),  # the results are ready on the side stream
        ("wait", "main", "event2"),
        ("record_stream", out.data_ptr(), "main"),
        # the reports' tensors, read when the step replays them, are kept for it too
        ("record_stream", flags.data_ptr(), "main"),
        ("record_stream", values.data_ptr(), "main"),
    ]
