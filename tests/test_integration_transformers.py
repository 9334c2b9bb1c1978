"""Tests of hf_shampoo/integrations/transformers.py and hf_shampoo/run.py with tiny models on CPU.

Covers registration by name (Python, command line, lazily at import), the AdamW-migration
defaults, ``optim_args`` parsing and early errors, the stable routes (``ShampooTrainer``,
``optimizer_cls_and_kwargs``), checkpoints resumed under 1 and 2 ranks (bitwise equal to the
uninterrupted run), the script launcher and the example.
"""

from __future__ import annotations

import sys
import textwrap
import types

import pytest
import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    HfArgumentParser,
    Trainer,
    TrainerControl,
    TrainingArguments,
)

from hf_shampoo import DistributedShampoo
from hf_shampoo.describe_table import describe
from hf_shampoo.integrations import transformers as hft
from hf_shampoo.integrations.transformers import registration
from tests.helpers import run
from tests.tiny_trainer import (
    WORKER_ARGS,
    dataset,
    group_of,
    shampoo_of,
    tiny_gpt2,
    train_and_resume,
    training_args,
)

pytestmark = pytest.mark.integrations


@pytest.fixture(scope="module", autouse=True)
def registered():
    assert hft.register()


# ---------------------------------------------------------------------- registration
def test_import_is_lazy_and_registers_when_transformers_loads(tmp_path):
    script = textwrap.dedent(
        f"""
        import sys
        import hf_shampoo
        from hf_shampoo.integrations.transformers import register_on_import
        register_on_import()  # what `import hf_shampoo` calls
        assert "transformers" not in sys.modules
        from transformers import HfArgumentParser, TrainingArguments
        args = TrainingArguments(output_dir={str(tmp_path)!r}, optim="distributed_shampoo",
                                 use_cpu=True, report_to=[])
        (cli,) = HfArgumentParser(TrainingArguments).parse_args_into_dataclasses(
            ["--optim", "distributed_shampoo", "--optim_args", "precondition_frequency=5",
             "--output_dir", {str(tmp_path)!r}, "--use_cpu"])
        assert cli.optim == args.optim == "distributed_shampoo", cli.optim
        assert "transformers.trainer" not in sys.modules
        from transformers import Trainer
        import transformers.trainer as trainer_module
        names = [c.__name__ for c in trainer_module.DEFAULT_CALLBACKS]
        assert names == ["DefaultFlowCallback", "ShampooCheckpointCallback"], names
        print("LAZY-OK")
        """
    )
    assert "LAZY-OK" in run([sys.executable, "-c", script])


def test_register_is_idempotent():
    import transformers.trainer as trainer_module
    from transformers.training_args import OptimizerNames

    try:
        from transformers.trainer_optimizer import _OPTIMIZER_HANDLERS
    except ModuleNotFoundError:  # 4.x: no handler registry, the static method is wrapped
        _OPTIMIZER_HANDLERS = None

    before = len(OptimizerNames)
    assert hft.register() and hft.register()
    assert len(OptimizerNames) == before
    assert OptimizerNames("distributed_shampoo") is OptimizerNames.DISTRIBUTED_SHAMPOO
    if _OPTIMIZER_HANDLERS is not None:
        assert OptimizerNames.DISTRIBUTED_SHAMPOO in _OPTIMIZER_HANDLERS
    else:
        assert trainer_module.Trainer.get_optimizer_cls_and_kwargs._hf_shampoo
    callback = hft.ShampooCheckpointCallback
    assert trainer_module.DEFAULT_CALLBACKS.count(callback) == 1
    assert hft.is_registered()


def test_version_guard(monkeypatch):
    import transformers

    monkeypatch.setattr(registration, "_version_ok", [])
    monkeypatch.setattr(transformers, "__version__", "6.1.0")
    with pytest.warns(UserWarning, match="outside the versions"):
        assert hft.register() is False
    monkeypatch.setattr(registration, "_version_ok", [])
    monkeypatch.setattr(transformers, "__version__", "5.23.0")
    assert hft.register() is True


def test_transformers_4x_route_wraps_get_optimizer_cls_and_kwargs(monkeypatch, tmp_path):
    """Without 5.x's handler registry, the Trainer's static method is wrapped instead."""

    class OldTrainer:
        @staticmethod
        def get_optimizer_cls_and_kwargs(args, model=None):
            return torch.optim.SGD, {"lr": args.learning_rate}

    module = types.SimpleNamespace(DEFAULT_CALLBACKS=[], Trainer=OldTrainer)
    monkeypatch.setitem(sys.modules, "transformers.trainer_optimizer", types.SimpleNamespace())
    registration._patch_trainer(module)
    registration._patch_trainer(module)  # idempotent
    assert module.DEFAULT_CALLBACKS == [hft.ShampooCheckpointCallback]
    ours = training_args(tmp_path, optim="distributed_shampoo")
    cls, kwargs = OldTrainer.get_optimizer_cls_and_kwargs(ours, tiny_gpt2())
    assert cls is DistributedShampoo and "params" in kwargs
    cls, _ = OldTrainer.get_optimizer_cls_and_kwargs(training_args(tmp_path, optim="sgd"))
    assert cls is torch.optim.SGD


# ---------------------------------------------------------------------- defaults
def test_trainer_by_name_uses_adamw_migration_defaults(tmp_path, caplog):
    args = training_args(
        tmp_path, optim="distributed_shampoo", learning_rate=3e-4, adam_beta1=0.8,
        adam_beta2=0.99, adam_epsilon=1e-7, weight_decay=0.05,
    )
    model = tiny_gpt2()
    trainer = Trainer(model=model, args=args, train_dataset=dataset())
    names = [type(c).__name__ for c in trainer.callback_handler.callbacks]
    assert names.index("DefaultFlowCallback") < names.index("ShampooCheckpointCallback")
    optimizer = shampoo_of(trainer)
    matrix = group_of(optimizer, "transformer.h.0.attn.c_attn.weight")
    assert matrix["lr"] == 3e-4 and matrix["betas"] == (0.8, 0.99)
    assert matrix["epsilon"] == 1e-12 and matrix["weight_decay_type"] == "decoupled"
    assert matrix["grafting"] == "adam" and matrix["grafting_beta2"] == 0.99
    assert matrix["grafting_epsilon"] == 1e-7
    assert matrix["precondition_frequency"] == 50 and matrix["max_preconditioner_dim"] == 512
    assert matrix["start_preconditioning_step"] is None
    decayed = {n for g in optimizer.param_groups for n in g["param_names"] if g["weight_decay"]}
    assert all(g["weight_decay"] in (0.0, 0.05) for g in optimizer.param_groups)
    trainer_decay = set(trainer.get_decay_parameter_names(model))  # lists tied aliases too
    assert decayed == {n for n, _ in model.named_parameters()} & trainer_decay
    assert group_of(optimizer, "transformer.ln_f.weight")["preconditioner"] == "diagonal"
    wte = group_of(optimizer, "transformer.wte.weight")
    assert wte["inverse_exponent_override"] == {2: {0: 0}}
    with caplog.at_level("WARNING"):
        trainer.train()
    assert optimizer.param_groups[0]["step"] == 3
    # 3 steps end before the first refresh (step 50): said once, at the start
    notes = [r.getMessage() for r in caplog.records if "first preconditioner refresh" in
             r.getMessage()]
    assert len(notes) == 1, notes
    assert "ends at step 3" in notes[0] and "refresh at step 50" in notes[0]
    assert "precondition_frequency" in notes[0]


def test_command_line_optim_name_and_args(tmp_path):
    (args,) = HfArgumentParser(TrainingArguments).parse_args_into_dataclasses(
        ["--optim", "distributed_shampoo", "--output_dir", str(tmp_path), "--use_cpu",
         "--optim_args",
         "precondition_frequency=5,betas=(0.9;0.95),*.c_fc.*@preconditioner=diagonal",
         "--report_to", "none"]
    )
    optimizer = shampoo_of(Trainer(model=tiny_gpt2(), args=args, train_dataset=dataset()))
    assert group_of(optimizer, "transformer.h.0.mlp.c_fc.weight")["preconditioner"] == "diagonal"
    matrix = group_of(optimizer, "transformer.h.0.attn.c_attn.weight")
    assert matrix["precondition_frequency"] == 5 and matrix["betas"] == (0.9, 0.95)


def test_soap_by_optim_args_switches_grafting_and_epsilon(tmp_path):
    args = training_args(tmp_path, optim="distributed_shampoo", adam_epsilon=1e-6,
                         optim_args="preconditioner=eigenvalue_corrected")
    optimizer = shampoo_of(Trainer(model=tiny_gpt2(), args=args, train_dataset=dataset()))
    matrix = group_of(optimizer, "transformer.h.0.attn.c_attn.weight")
    assert matrix["preconditioner"] == "eigenvalue_corrected"
    assert matrix["grafting"] is None and matrix["epsilon"] == 1e-6
    norm = group_of(optimizer, "transformer.ln_f.weight")
    assert norm["preconditioner"] == "diagonal" and norm["grafting"] == "adam"


# ---------------------------------------------------------------------- optim_args
def test_optim_args_are_cast_to_their_types():
    parsed = hft.parse_optim_args(
        "lr=0.1,betas=(0.9;0.99),nesterov=true,start_preconditioning_step=none,"
        "inverse_exponent_override={2:{0:0;1:0.5}},factor_matrix_dtype=float64,grafting=none,"
        "precondition_frequency=10,communication_dtype=bf16,beta3=0.95,preset=cnn,"
        "lm_head@max_preconditioner_dim=256"
    )
    assert parsed.kwargs == {
        "lr": 0.1, "betas": (0.9, 0.99), "nesterov": True, "start_preconditioning_step": None,
        "inverse_exponent_override": {2: {0: 0, 1: 0.5}}, "factor_matrix_dtype": torch.float64,
        "grafting": None, "precondition_frequency": 10, "communication_dtype": torch.bfloat16,
        "beta3": 0.95,
    }
    assert isinstance(parsed.kwargs["precondition_frequency"], int)
    assert parsed.preset == "cnn"
    assert parsed.overrides == {"lm_head": {"max_preconditioner_dim": 256}}
    # commas inside brackets are fine where transformers does not split first
    assert hft.parse_optim_args("betas=(0.9,0.9)").kwargs["betas"] == (0.9, 0.9)


@pytest.mark.parametrize(
    "optim_args, message",
    [
        ("precondition_freq=5",
         r"unknown optim_args key 'precondition_freq' \(did you mean 'precondition_frequency'"),
        ("lm_head@precondition_freq=5", r"did you mean 'precondition_frequency'"),
        ("preset=muno", r"unknown optim_args preset 'muno' \(did you mean 'muon'"),
        ("lr=0.1,precondition_frequency=5,lr=0.2", r"sets 'lr' twice"),
        ("lm_head@lr=0.1,lm_head @ lr=0.2", r"sets 'lm_head@lr' twice"),
        ("preset=cnn,preset=muon", r"sets 'preset' twice"),
        ("nothing.matches@lr=0.1", "matched no parameter"),
        ("precondition_frequency=0", "precondition_frequency"),
        ("precondition_frequency=2.5", "expected an integer"),
        ("grafting=adamw", "grafting"),
        ("nesterov=maybe", "true or false"),
        ("betas=(0.9,0.99)", "write ';'"),
        ("lm_head@lr=-1", "lr"),
        ("preset=vit", "preset"),
    ],
)
def test_bad_optim_args_fail_when_the_trainer_is_built(tmp_path, optim_args, message):
    args = training_args(tmp_path, optim="distributed_shampoo", optim_args=optim_args)
    with pytest.raises(ValueError, match=message):
        Trainer(model=tiny_gpt2(), args=args, train_dataset=dataset())


def test_whitespace_is_ignored_around_keys_patterns_and_values():
    parsed = hft.parse_optim_args(
        " preset= muon , precondition_frequency = 5, lm_head @ max_preconditioner_dim = 64,"
        "betas=( 0.9 ; 0.95 )")
    assert parsed.preset == "muon"
    assert parsed.kwargs == {"precondition_frequency": 5, "betas": (0.9, 0.95)}
    assert parsed.overrides == {"lm_head": {"max_preconditioner_dim": 64}}
    assert hft.parse_optim_args({"preset": " cnn "}).preset == "cnn"


@pytest.mark.parametrize("optim, optim_args, inert", [
    ("distributed_shampoo", "newton_schulz_dtype=bf16,lr=1e-3", "newton_schulz_dtype"),
    ("distributed_muon", "precondition_frequency=5", "precondition_frequency"),
    ("distributed_muon", "epsilon=1e-10,newton_schulz_iterations=6", "epsilon"),
])
def test_keywords_no_group_uses_are_reported(tmp_path, optim, optim_args, inert):
    args = training_args(tmp_path, optim=optim, optim_args=optim_args)
    trainer = Trainer(model=tiny_gpt2(), args=args, train_dataset=dataset())
    with pytest.warns(UserWarning, match="change nothing here") as record:
        shampoo_of(trainer)
    (message,) = [str(w.message) for w in record if "change nothing" in str(w.message)]
    assert repr(inert) in message
    assert all(repr(key) not in message for key in ("lr", "newton_schulz_iterations"))


def test_keywords_every_group_uses_are_not_reported(tmp_path, recwarn):
    for optim, optim_args in (("distributed_shampoo", "precondition_frequency=5,epsilon=1e-10"),
                              ("distributed_muon", "newton_schulz_dtype=bf16,lr=1e-3")):
        args = training_args(tmp_path, optim=optim, optim_args=optim_args)
        shampoo_of(Trainer(model=tiny_gpt2(), args=args, train_dataset=dataset()))
    assert not [w for w in recwarn if "change nothing" in str(w.message)]


def test_override_pattern_matching_nothing_fails_when_the_trainer_is_built(tmp_path):
    args = training_args(tmp_path, optim_args="precondition_frequency=2")
    with pytest.raises(ValueError, match="'nothing' matched no parameter"):
        hft.ShampooTrainer(model=tiny_gpt2(), args=args, train_dataset=dataset(),
                           module_overrides={"nothing": {"lr": 0.1}})
    with pytest.raises(ValueError, match="unknown preset 'muno' \\(did you mean 'muon'"):
        hft.ShampooTrainer(model=tiny_gpt2(), args=args, preset="muno")


def test_unknown_key_error_lists_valid_keys():
    with pytest.raises(ValueError) as error:
        hft.parse_optim_args("foo=1")
    for key in ("lr", "betas", "max_preconditioner_dim", "grafting_epsilon", "preset"):
        assert key in str(error.value)


# ---------------------------------------------------------------------- stable routes
def test_shampoo_trainer_needs_no_registration(tmp_path, caplog):
    args = training_args(tmp_path, optim_args="precondition_frequency=2")  # optim: AdamW default
    trainer = hft.ShampooTrainer(
        model=tiny_gpt2(), args=args, train_dataset=dataset(),
        shampoo_kwargs={"max_preconditioner_dim": 64},
        module_overrides={"*.attn.*": {"preconditioner": "diagonal"}},
    )
    names = [type(c).__name__ for c in trainer.callback_handler.callbacks]
    assert names.count("ShampooCheckpointCallback") == 1
    assert names[-1] == "ShampooCheckpointCallback"  # sees should_save as the others left it
    optimizer = shampoo_of(trainer)
    matrix = group_of(optimizer, "transformer.h.0.mlp.c_fc.weight")
    assert matrix["precondition_frequency"] == 2 and matrix["max_preconditioner_dim"] == 64
    assert group_of(optimizer, "transformer.h.0.attn.c_attn.weight")["preconditioner"] == "diagonal"
    with caplog.at_level("WARNING"):
        trainer.train()
    assert not any("first preconditioner refresh" in r.getMessage() for r in caplog.records)
    with pytest.raises(ValueError, match="precondition_frequency"):
        hft.ShampooTrainer(model=tiny_gpt2(), args=args,
                           shampoo_kwargs={"precondition_frequency": 0})


def test_optimizer_cls_and_kwargs_route(tmp_path):
    args = training_args(tmp_path, learning_rate=1e-3)
    model = tiny_gpt2()
    trainer = Trainer(
        model=model, args=args, train_dataset=dataset(),
        optimizer_cls_and_kwargs=hft.optimizer_cls_and_kwargs(args, model),
    )
    optimizer = shampoo_of(trainer)
    assert "transformer.wte.weight" in describe(optimizer)
    cls, kwargs = hft.optimizer_cls_and_kwargs(args)  # no model: the Trainer's two groups
    assert cls is DistributedShampoo and "params" not in kwargs and kwargs["lr"] == 1e-3


def test_callback_consolidates_only_before_optimizer_saves(tmp_path):
    callback = hft.ShampooCheckpointCallback()
    calls = []

    class Recorder:
        def consolidate_state_dict(self, to=0):
            calls.append(to)

    shampoo = DistributedShampoo([torch.nn.Parameter(torch.zeros(2))])
    shampoo.consolidate_state_dict = Recorder().consolidate_state_dict
    wrapped = types.SimpleNamespace(optimizer=shampoo)  # as Accelerate wraps it
    cases = [
        ({"save_strategy": "steps"}, {"should_save": True}, 1),
        ({"save_strategy": "steps"}, {"should_save": False}, 0),
        ({"save_strategy": "steps", "save_only_model": True}, {"should_save": True}, 0),
        ({"save_strategy": "best", "eval_strategy": "steps", "metric_for_best_model": "loss"},
         {"should_evaluate": True}, 1),
    ]
    for arg_kwargs, control_kwargs, expected in cases:
        calls.clear()
        args = training_args(tmp_path, **arg_kwargs)
        callback.on_step_end(args, None, TrainerControl(**control_kwargs), optimizer=wrapped)
        assert len(calls) == expected, (arg_kwargs, control_kwargs)
    calls.clear()
    callback.on_epoch_end(args, None, TrainerControl(should_save=True), optimizer=torch.optim.SGD(
        [torch.nn.Parameter(torch.zeros(1))], lr=0.1))  # another optimizer: left alone
    assert calls == []


# ---------------------------------------------------------------------- checkpoints, scripts
def test_unmodified_script_single_process_resume(tmp_path):
    result = train_and_resume(tmp_path, WORKER_ARGS, 1)
    losses = result["losses_a"]
    assert losses["8"] < losses["1"]


@pytest.mark.parametrize("ranks", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_trainer_resume_with_refreshes_pending_is_exact(tmp_path, ranks):
    """``refresh_delay=1`` through ``optim_args``: the Trainer's checkpoint at step 4 holds
    refreshes still pending (staggered, f = 2: due at step 5; on 2 ranks gathered into
    rank 0's file), and the resumed run's losses and parameters equal the uninterrupted
    run's, bit for bit."""
    worker_args = list(WORKER_ARGS)
    at = worker_args.index("--optim_args") + 1
    worker_args[at] += ",refresh_delay=1"
    train_and_resume(tmp_path, worker_args, ranks)
    saved = torch.load(tmp_path / "out" / "checkpoint-4" / "optimizer.pt", weights_only=True)
    due = [int(t) for entry in saved["state"].values() for key, t in entry.items()
           if key.endswith(".refresh_due_step")]
    assert saved["param_groups"][0]["refresh_delay"] == 1
    assert 5 in due, due  # some block's refresh was pending at the save


@pytest.mark.slow
def test_two_ranks_trainer_checkpoint_resumes_exactly(tmp_path):
    train_and_resume(tmp_path, WORKER_ARGS, 2)
    # the consolidated file also loads into one process (another world size)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64,
                                       n_positions=16, bos_token_id=0, eos_token_id=0))
    args = training_args(tmp_path, optim="distributed_shampoo",
                         optim_args="precondition_frequency=2,max_preconditioner_dim=64")
    optimizer = hft.create_optimizer(model, args)
    saved = torch.load(tmp_path / "out" / "checkpoint-4" / "optimizer.pt", weights_only=True)
    optimizer.load_state_dict(saved)
    assert optimizer.state_dict()["state"].keys() == saved["state"].keys()


def test_run_module_and_script_modes(tmp_path, monkeypatch, capsys):
    from hf_shampoo import run as launcher

    (tmp_path / "probe_module.py").write_text(
        "import sys\nRESULT = list(sys.argv)\nprint('MODULE', __name__, sys.argv[1:])\n"
    )
    (tmp_path / "probe.py").write_text("import sys\nprint('SCRIPT', __name__, sys.argv)\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["x"])
    monkeypatch.setattr(sys, "path", list(sys.path))
    launcher.main(["-m", "probe_module", "--optim", "distributed_shampoo"])
    launcher.main([str(tmp_path / "probe.py"), "a", "--b"])
    out = capsys.readouterr().out
    assert "MODULE __main__ ['--optim', 'distributed_shampoo']" in out
    assert f"SCRIPT __main__ [{str(tmp_path / 'probe.py')!r}, 'a', '--b']" in out
    with pytest.raises(SystemExit):
        launcher.main([str(tmp_path / "missing.py")])


def test_example_prints_decreasing_loss(tmp_path):
    pytest.importorskip("matplotlib")
    out = run([sys.executable, "examples/finetune_transformers.py", "--steps", "16",
               "--log-every", "4", "--batch-size", "8", "--block-size", "32", "--describe",
               "--optim-args", "precondition_frequency=4", "--plot", str(tmp_path / "h.png")])
    line = next(row for row in out.splitlines()
                if row.startswith("distributed_shampoo: training loss"))
    first, last = (float(x) for x in line.split("training loss ")[1].split(";")[0].split(" -> "))
    assert last < first
    assert "shampoo (dim 0 off)" in out
    # the health at the end (docs/metrics.md) and its picture
    assert "optimizer health at step 16 (docs/metrics.md): steps 16, preconditioning 1" in out
    assert (tmp_path / "h.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_save_on_each_node_consolidates_onto_each_nodes_first_rank(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    args = types.SimpleNamespace(save_on_each_node=True, world_size=6)
    assert hft.save_ranks(args) == [0, 2, 4]
    args.save_on_each_node = False
    assert hft.save_ranks(args) == [0]


def test_create_optimizer_passes_a_process_group_through(tmp_path, monkeypatch):
    """A pipeline stage's part through the Trainer's builder: ``process_group`` reaches
    the optimizer's constructor unchanged (recorded here, in one process; a real group
    needs a launched world: tests/test_pipeline_parallel.py, tests/test_rank_agreement.py)."""
    from hf_shampoo.integrations.transformers import arguments

    seen = {}

    class Recorder(arguments.DistributedShampoo):
        def __init__(self, params, **kwargs):
            seen["process_group"] = kwargs.pop("process_group", "absent")
            super().__init__(params, **kwargs)

    monkeypatch.setattr(arguments, "DistributedShampoo", Recorder)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32,
                                       n_positions=8, bos_token_id=0, eos_token_id=0))
    group = object()
    optimizer = hft.create_optimizer(model, training_args(tmp_path, optim="distributed_shampoo"),
                                     process_group=group)
    assert seen["process_group"] is group and isinstance(optimizer, Recorder)
