"""Every fenced code block of README.md and docs/*.md is run or checked, so the docs stay true.

Rules, by the fence's language tag:

- ``python``: executed. The blocks of one file run in order in one namespace (like doctest
  globals: a later block may use names from an earlier one), in a fresh process per file
  (forked from a server that has only imported torch, see ``FORK_SERVER``), with
  ``OMP_NUM_THREADS=1``, offline (``HF_HUB_OFFLINE=1``), in a temporary working directory
  (so ``output_dir="out"`` and the like land there) and with this checkout first on
  ``PYTHONPATH``. A block whose first line is a comment naming
  ``torchrun --nproc_per_node N`` is a whole script that only makes sense under a launcher:
  it runs alone, written to a file, under ``python -m torch.distributed.run --standalone
  --nproc_per_node N`` (its code must pick gloo and a "cpu" mesh). No python block is
  skipped.
- ``bash`` / ``sh`` / ``shell``: every line is a command (``\\`` continues a line, ``#``
  starts a comment, leading ``VAR=value`` assignments are dropped, ``...`` stands for
  "more arguments" and is ignored). Known commands, and what is checked:

  - ``make TARGET``: the target is defined in the Makefile;
  - ``export NAME=VALUE``: an assignment (the value, maybe a ``$(...)``, is not checked);
  - ``srun [--option=value ...] COMMAND`` (SLURM's launcher, written with ``=``) and
    ``bash -c "COMMAND"``: COMMAND is checked as a line of its own;
  - ``pip install``: every extra named as ``.[extra]`` or ``hf_shampoo[extra]`` (also in
    the line's comment) is an optional-dependency group of pyproject.toml;
  - ``python SCRIPT ARGS`` (also ``.venv/bin/python``), ``python -m torch.distributed.run
    ...``, ``torchrun ...``, ``accelerate launch ...``, ``python -m hf_shampoo.run ...``:
    the script exists in this repository, and every ``--flag`` written for it appears in
    its ``--help``; the launchers' own flags appear in ``torchrun --help`` /
    ``accelerate launch --help``. After a launcher, the script is the first word ending in
    ``.py`` or the word after ``-m``; words between are launcher flags and their values.
    All ``--help`` texts are collected in one process (each script run by ``runpy`` with
    ``sys.argv = [script, "--help"]``) to pay for the imports once.
  - ``python -m benchmarks.NAME ARGS`` (also after a launcher) and ``python -m
    hf_shampoo.plot ARGS``: ``benchmarks/NAME.py`` (``hf_shampoo/plot.py``) exists and its
    ``--help`` (collected by ``runpy.run_module``) has every ``--flag``.
  - Scripts that are not in this repository are allowed only by name, from
    ``EXTERNAL_SCRIPTS``: transformers' ``run_clm.py`` and ``-m my_package.train`` (flags
    checked against ``HfArgumentParser(TrainingArguments)``), and ``train.py`` (timm's
    training script, not shipped in the timm wheel: flags checked against a list taken from
    it; in the launcher examples ``train.py`` is the reader's own script and has no flags).

  Any other command fails the test (teach it the new command). Commands in ``RUN_COMMANDS``
  are cheap as written and are also run, from the repository root, and their output is
  checked (the DDP example must end with identical ranks).
- ``yaml``: parsed; one with a ``compute_environment`` key is an Accelerate config file
  and must load with Accelerate's own loader (``ClusterConfig.from_yaml_file``: no unknown
  key, a known ``distributed_type``).
- untyped blocks: commands if any line starts with one of the commands above (then checked
  as a ``bash`` block), otherwise output or a diagram (e.g. a ``describe()`` table, the
  package layout) and ignored. ``text`` blocks are always ignored. Any other language tag
  fails the test.

Also checked: every relative link (and ``#anchor``, by GitHub's heading slugs) of these
files, BENCHMARKS.md, docs/benchmarks/ and the folders' README.md files resolves; README.md
stays a front page (at most ``README_MAX_LINES`` lines, the Trainer example before line
``TRAINER_EXAMPLE_BEFORE_LINE``). The runs that start two processes under torchrun are marked
``slow``.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

pytestmark = pytest.mark.integrations

REPO = Path(__file__).resolve().parent.parent
DOC_FILES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

SHELL_LANGS = {"bash", "sh", "shell"}
IGNORED_LANGS = {"text"}
TORCHRUN_MARK = re.compile(r"^#.*\btorchrun --nproc_per_node (\d+)\b")
PYTHON_WORD = re.compile(r"^(\S*/)?python(3(\.\d+)?)?$")
ENV_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
# the package's own command-line modules besides hf_shampoo.run, checked like benchmarks
PACKAGE_COMMANDS = ("hf_shampoo.plot",)
COMMAND_WORDS = {"make", "pip", "torchrun", "accelerate", "bash", "export", "srun"}

# Flags of timm's train.py that the docs use, taken from pytorch-image-models' train.py
# (aa4b585, timm 1.0.29.dev0; the timm wheel does not ship the script).
TIMM_TRAIN_FLAGS = (
    "--data-dir --model --device-modules --opt --opt-eps --opt-betas --opt-kwargs "
    "--weight-decay --sched --lr --resume --pretrained --batch-size"
)
EXTERNAL_SCRIPTS = {
    "run_clm.py": "transformers:TrainingArguments",
    "my_package.train": "transformers:TrainingArguments",
    "train.py": "train.py (timm's, or the reader's own)",
}
# Doc commands that finish in seconds as written: run them (file name, exact command).
# (file, command) -> lines its output must contain
RUN_COMMANDS = {
    ("docs/distributed.md",
     "OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 2 examples/ddp_train.py"):
        ("world 2:", "ranks hold identical parameters: True"),
}


@dataclass
class Block:
    path: Path
    line: int  # line of the first code line in the file (1-based)
    lang: str
    code: str

    @property
    def where(self) -> str:
        return f"{rel(self.path)}:{self.line}"


def rel(path: Path) -> str:
    return str(path.relative_to(REPO))


def parse_blocks(path: Path) -> list[Block]:
    """Fenced blocks of a markdown file, also indented ones (inside list items)."""
    blocks, lines = [], path.read_text().split("\n")
    i = 0
    while i < len(lines):
        opening = re.match(r"^(\s*)```(\S*)\s*$", lines[i])
        if not opening:
            i += 1
            continue
        indent, lang = len(opening.group(1)), opening.group(2).lower()
        start, i = i + 1, i + 1
        while i < len(lines) and not re.match(r"^\s*```\s*$", lines[i]):
            i += 1
        assert i < len(lines), f"{path}:{start}: unclosed code fence"
        code = "\n".join(line[indent:] for line in lines[start:i])
        blocks.append(Block(path, start + 1, lang, code + "\n"))
        i += 1
    return blocks


ALL_BLOCKS = [block for path in DOC_FILES for block in parse_blocks(path)]


# ---------------------------------------------------------------- shell commands


def command_lines(code: str) -> list[tuple[int, str]]:
    """(line offset, command) of a shell block: continuations joined, comments and blanks
    dropped."""
    commands, offset, pending, start = [], 0, "", 0
    for offset, line in enumerate(code.split("\n")):
        if not pending:
            start = offset
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        text, pending = (pending + line).strip(), ""
        if text and not text.startswith("#"):
            commands.append((start, text))
    return commands


def command_words(line: str) -> list[str]:
    words = shlex.split(line, comments=True)
    while words and ENV_ASSIGNMENT.match(words[0]):
        words = words[1:]
    return [w for w in words if w != "..."]


def is_command(line: str) -> bool:
    words = command_words(line)
    return bool(words) and (words[0] in COMMAND_WORDS or bool(PYTHON_WORD.match(words[0])))


def shell_blocks() -> list[Block]:
    """``bash``/``sh`` blocks, and untyped blocks that hold commands (the rest is output)."""
    return [b for b in ALL_BLOCKS if b.lang in SHELL_LANGS
            or (b.lang == "" and any(is_command(line) for _, line in command_lines(b.code)))]


@dataclass
class Check:
    """One thing a command asks of the repository."""

    kind: str  # "program" (flags against a help text), "make", "extra", "part", "error"
    name: str
    flags: tuple[str, ...] = ()


def long_flags(words: list[str]) -> tuple[str, ...]:
    return tuple(w.split("=", 1)[0] for w in words if w.startswith("--"))


def split_launcher(words: list[str]) -> tuple[list[str], str | None, bool, list[str]]:
    """Launcher words → (its flags, target script or module, is_module, target's words)."""
    flags = []
    for i, word in enumerate(words):
        if word in ("-m", "--module"):
            flags.append(word)
            if i + 1 >= len(words):
                return flags, None, True, []
            return flags, words[i + 1], True, words[i + 2:]
        if word.startswith("-"):
            flags.append(word.split("=", 1)[0])
        elif word.endswith(".py"):
            return flags, word, False, words[i + 1:]
    return flags, None, False, []


def target_checks(target: str | None, is_module: bool, words: list[str]) -> list[Check]:
    if target is None:
        return [Check("error", "no script found after the launcher")]
    if is_module:
        if target == "hf_shampoo.run":
            return hf_run_checks(words)
        if target == "pytest":  # the test files named must exist (-m / -k take a value)
            named = [w for i, w in enumerate(words) if not w.startswith("-")
                     and (i == 0 or words[i - 1] not in ("-m", "-k"))]
            return [Check("error", f"no such test file: {w}") for w in named
                    if not (REPO / w.split("::")[0]).exists()]
        if target in EXTERNAL_SCRIPTS:
            return [Check("program", EXTERNAL_SCRIPTS[target], long_flags(words))]
        if target.startswith("benchmarks.") or target in PACKAGE_COMMANDS:
            # python -m benchmarks.NAME: benchmarks/NAME.py (hf_shampoo.plot: its file)
            if not (REPO / (target.replace(".", "/") + ".py")).is_file():
                return [Check("error", f"no such benchmark module: {target}")]
            return [Check("program", f"-m {target}", long_flags(words))]
        return [Check("error", f"unknown module {target!r} (add it to the test)")]
    if target in EXTERNAL_SCRIPTS:
        return [Check("program", EXTERNAL_SCRIPTS[target], long_flags(words))]
    if not (REPO / target).is_file():
        return [Check("error", f"no such script: {target}")]
    return [Check("program", target, long_flags(words))]


def hf_run_checks(words: list[str]) -> list[Check]:
    """``python -m hf_shampoo.run [-m MODULE | SCRIPT] ARGS``."""
    if words[:1] == ["-m"]:
        return target_checks(words[1] if len(words) > 1 else None, True, words[2:])
    if not words:
        return [Check("error", "hf_shampoo.run without a script")]
    return target_checks(words[0], False, words[1:])


def launcher_checks(launcher: str, words: list[str]) -> list[Check]:
    flags, target, is_module, rest = split_launcher(words)
    return [Check("program", launcher, tuple(flags)), *target_checks(target, is_module, rest)]


def checks_for(line: str) -> list[Check]:
    """What one command line asks of the repository (see the module docstring)."""
    words = command_words(line)
    head, rest = words[0], words[1:]
    if head == "make":
        return [Check("make", target) for target in rest if not target.startswith("-")]
    if head == "pip":
        if rest[:1] != ["install"]:
            return [Check("error", f"pip {rest[:1]}: only pip install is known")]
        # the extras, also those in the comment ("# or: pip install -e '.[dev]'"), of a
        # checkout (.[dev]) or of the package by name (hf_shampoo[timm])
        extras = [e.strip() for group in re.findall(r"(?:\.|\bhf_shampoo)\[([^\]]+)\]", line)
                  for e in group.split(",")]
        return [Check("extra", extra) for extra in extras]
    if head == "export":  # export NAME=VALUE: the value may be a $(command), not checked
        if not rest or not ENV_ASSIGNMENT.match(rest[0]):
            return [Check("error", "export without NAME=VALUE")]
        return []
    if head == "srun":  # srun [--option=value ...] COMMAND: the command as a line of its own
        while rest and rest[0].startswith("-"):
            rest = rest[1:]
        if not rest:
            return [Check("error", "srun without a command")]
        return checks_for(shlex.join(rest))
    if head == "bash" and rest[:1] == ["-c"]:  # bash -c "COMMAND"
        if len(rest) < 2:
            return [Check("error", "bash -c without a command")]
        return checks_for(rest[1])
    if head == "bash":  # bash SCRIPT.sh [PART]: PART must be one of the script's cases
        if not rest or not rest[0].endswith(".sh") or not (REPO / rest[0]).is_file():
            return [Check("error", f"bash {' '.join(rest[:1])}: no such script")]
        return [Check("part", rest[0], tuple(rest[1:]))]
    if head == "torchrun":
        return launcher_checks("torchrun", rest)
    if head == "accelerate":
        if rest[:1] != ["launch"]:
            return [Check("error", f"accelerate {rest[:1]}: only accelerate launch is known")]
        return launcher_checks("accelerate launch", rest[1:])
    if PYTHON_WORD.match(head):
        if rest[:1] == ["-m"]:
            module, args = (rest[1] if len(rest) > 1 else None), rest[2:]
            if module == "torch.distributed.run":
                return launcher_checks("torchrun", args)
            return target_checks(module, True, args)
        if not rest:
            return [Check("error", "python without a script")]
        return target_checks(rest[0], False, rest[1:])
    return [Check("error", f"unknown command {head!r} (teach tests/test_docs_snippets.py)")]


SHELL_COMMANDS = [(block, block.line + offset, line) for block in shell_blocks()
                  for offset, line in command_lines(block.code)]


def flag_in_help(flag: str, help_text: str) -> bool:
    return re.search(r"(?<![\w-])" + re.escape(flag) + r"(?![\w-])", help_text) is not None


def script_parts(script: str) -> set[str]:
    """The words a shell script's ``case`` accepts (``    name)`` lines)."""
    return set(re.findall(r"^\s*([\w-]+)\)", (REPO / script).read_text(), flags=re.M))


def makefile_targets() -> set[str]:
    text = (REPO / "Makefile").read_text()
    return set(re.findall(r"^([A-Za-z0-9_.-]+)\s*:(?!=)", text, flags=re.M))


def pyproject_extras() -> set[str]:
    """Keys of ``[project.optional-dependencies]`` (read by hand: tomllib needs 3.11)."""
    text = (REPO / "pyproject.toml").read_text()
    section = re.search(r"^\[project\.optional-dependencies\]\n(.*?)(?=^\[|\Z)", text,
                        flags=re.M | re.S)
    return set(re.findall(r"^([A-Za-z0-9_.-]+)\s*=", section.group(1), flags=re.M)) if section \
        else set()


HELP_COLLECTOR = r"""
import contextlib, io, json, os, runpy, sys, traceback

def collect(argv, run):
    buffer = io.StringIO()
    sys.argv = list(argv)
    with contextlib.redirect_stdout(buffer), contextlib.redirect_stderr(buffer):
        try:
            run()
        except SystemExit:
            pass
        except BaseException:
            traceback.print_exc()
    return buffer.getvalue()

def training_arguments():
    import hf_shampoo  # noqa: F401  (adds optim="distributed_shampoo" to the choices)
    from transformers import HfArgumentParser, TrainingArguments
    print(HfArgumentParser(TrainingArguments).format_help())

programs, out = json.loads(sys.argv[1]), sys.argv[2]
helps = {}
for name in programs:
    if name == "torchrun":
        run = lambda: runpy.run_module("torch.distributed.run", run_name="__main__")
        helps[name] = collect(["torchrun", "--help"], run)
    elif name == "accelerate launch":
        run = lambda: runpy.run_module("accelerate.commands.accelerate_cli", run_name="__main__")
        helps[name] = collect(["accelerate", "launch", "--help"], run)
    elif name == "transformers:TrainingArguments":
        helps[name] = collect(["run_clm.py", "--help"], training_arguments)
    elif name.startswith("-m "):  # a module of this checkout (python -m benchmarks.NAME)
        run = lambda: runpy.run_module(name[3:], run_name="__main__", alter_sys=True)
        helps[name] = collect([name[3:], "--help"], run)
    else:  # a script, with its folder first on sys.path as `python SCRIPT` has it
        sys.path.insert(0, os.path.dirname(os.path.abspath(name)))
        run = lambda: runpy.run_path(name, run_name="__main__")
        helps[name] = collect([name, "--help"], run)
with open(out, "w") as f:
    json.dump(helps, f)
"""


def subprocess_env() -> dict[str, str]:
    """One thread, offline, this checkout first on the path, no launcher variables."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p))
    return env


# Runs each job in a child forked from an interpreter that has imported torch and
# torch._dynamo (which the first optimizer loads): ~5 s that every file would pay again.
# Nothing else is imported first, so the blocks import hf_shampoo, transformers and timm in
# their own order, as a reader's script does.
FORK_SERVER = r"""
import json, os, signal, sys, time, traceback

import torch
import torch._dynamo

def run(job):
    os.chdir(job["cwd"])
    log = os.open(job["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    sys.argv = job["argv"]
    try:
        exec(compile(job["source"], job["argv"][0], "exec"), {"__name__": "__main__"})
        return 0
    except SystemExit as stop:
        return stop.code if isinstance(stop.code, int) else int(stop.code is not None)
    except BaseException:
        traceback.print_exc()
        return 1

print("ready", flush=True)
for line in sys.stdin:
    job = json.loads(line)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            code = run(job)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    deadline = time.monotonic() + job["timeout"]
    while not (done := os.waitpid(pid, os.WNOHANG))[0]:
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
        time.sleep(0.02)
    print(json.dumps(os.waitstatus_to_exitcode(done[1])), flush=True)
"""


@pytest.fixture(scope="module")
def fork_server(tmp_path_factory):
    """``run(source, argv, cwd, timeout) -> (exit code, output)`` in a fresh forked process."""
    home = tmp_path_factory.mktemp("fork_server")
    server = subprocess.Popen([sys.executable, "-c", FORK_SERVER], cwd=home,
                              env=subprocess_env(), stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    assert server.stdout.readline() == "ready\n", "the fork server did not start"
    jobs = iter(range(10**6))

    def run(source: str, argv: list[str], cwd: Path, timeout: int) -> tuple[int, str]:
        log = home / f"job{next(jobs)}.log"
        job = dict(source=source, argv=argv, cwd=str(cwd), log=str(log), timeout=timeout)
        server.stdin.write(json.dumps(job) + "\n")
        server.stdin.flush()
        answer = server.stdout.readline()
        assert answer, "the fork server died"
        code = json.loads(answer)
        output = log.read_text() if log.exists() else ""
        return code, output + (f"\n(killed after {timeout} s)" if code == -9 else "")

    yield run
    server.stdin.close()
    server.wait(timeout=60)


@pytest.fixture(scope="module")
def help_texts(fork_server, tmp_path_factory) -> dict[str, str]:
    """``--help`` of every program the docs' commands name, from one process."""
    programs = sorted({c.name for _, _, line in SHELL_COMMANDS for c in checks_for(line)
                       if c.kind == "program" and c.name != EXTERNAL_SCRIPTS["train.py"]})
    out = tmp_path_factory.mktemp("help") / "help.json"
    code, output = fork_server(HELP_COLLECTOR, ["<help collector>", json.dumps(programs),
                                                str(out)], cwd=REPO, timeout=180)
    assert code == 0, output[-6000:]
    helps = json.loads(out.read_text())
    helps[EXTERNAL_SCRIPTS["train.py"]] = TIMM_TRAIN_FLAGS
    return helps


def test_every_block_has_a_known_language():
    known = {"python", "", "yaml", *SHELL_LANGS, *IGNORED_LANGS}
    unknown = [f"{b.where}: ```{b.lang}" for b in ALL_BLOCKS if b.lang not in known]
    assert not unknown, "teach tests/test_docs_snippets.py these blocks:\n" + "\n".join(unknown)


def test_shell_blocks_hold_only_known_commands():
    """A bash block's every line is a command this test knows (output goes in ```text)."""
    bad = [f"{rel(block.path)}:{n}: {line}" for block, n, line in SHELL_COMMANDS
           if not is_command(line)]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("where, line",
                         [(f"{rel(b.path)}:{n}", line) for b, n, line in SHELL_COMMANDS],
                         ids=[f"{rel(b.path)}:{n}" for b, n, _ in SHELL_COMMANDS])
def test_shell_command_names_what_exists(where, line, help_texts):
    problems = []
    for check in checks_for(line):
        if check.kind == "error":
            problems.append(check.name)
        elif check.kind == "make" and check.name not in makefile_targets():
            problems.append(f"make target {check.name!r} is not in the Makefile")
        elif check.kind == "extra" and check.name not in pyproject_extras():
            problems.append(f"extra {check.name!r} is not in pyproject.toml")
        elif check.kind == "part":
            problems += [f"{check.name} has no part {part!r}" for part in check.flags
                         if part not in script_parts(check.name)]
        elif check.kind == "program":
            text = help_texts[check.name]
            problems += [f"{check.name} does not accept {flag}" for flag in check.flags
                         if not flag_in_help(flag, text)]
    assert not problems, f"{where}: {line}\n" + "\n".join(problems)


def test_the_flag_checks_can_fail():
    """A misspelt flag or script, or an unknown command, is reported."""
    checks = checks_for("torchrun --nproc_per_node 2 examples/ddp_train.py --stepz 3")
    assert [c.flags for c in checks if c.name == "examples/ddp_train.py"] == [("--stepz",)]
    assert not flag_in_help("--stepz", "  --steps STEPS\n  --steps-per-epoch N")
    assert flag_in_help("--nproc_per_node", "  --nproc_per_node NPROC, --nproc-per-node N")
    assert checks_for("python examples/nope.py")[0].kind == "error"
    assert checks_for("rm -rf outputs")[0].kind == "error"
    assert checks_for("pip install 'hf_shampoo[timm,nope]'  # or: '.[dev]'") == [
        Check("extra", "timm"), Check("extra", "nope"), Check("extra", "dev")]
    assert "nope" not in pyproject_extras() and "timm" in pyproject_extras()
    assert checks_for("bash benchmarks/nope.sh step")[0].kind == "error"
    assert checks_for("python -m pytest -q tests/test_nope.py")[0].kind == "error"
    assert checks_for("python -m pytest -q tests/test_gpu.py") == []
    assert checks_for("python -m pytest -q -m device tests/test_gpu.py") == []
    assert checks_for("python -m benchmarks.nope --steps 3")[0].kind == "error"
    assert checks_for("python -m benchmarks.ablation --smok") == [
        Check("program", "-m benchmarks.ablation", ("--smok",))]
    assert [c.flags for c in checks_for('srun --nodes=2 bash -c "torchrun --nnodez 2 x.py"')
            if c.name == "torchrun"] == [("--nnodez",)]
    assert checks_for("srun --nodes=2")[0].kind == "error"
    assert checks_for("export HEAD=$(scontrol show hostnames)") == []
    assert checks_for("export --nope")[0].kind == "error"
    (part,) = checks_for("bash benchmarks/gpu_session.sh stpe")
    assert part.flags == ("stpe",) and "stpe" not in script_parts(part.name)
    assert "step" in script_parts(part.name)


@pytest.mark.slow  # two processes under torchrun: 12-24 s on two busy cores
@pytest.mark.parametrize("where, command", sorted(RUN_COMMANDS))
def test_cheap_command_runs(where, command):
    assert any(b.path == REPO / where and line == command for b, _, line in SHELL_COMMANDS), \
        f"{command!r} is no longer in {where}: update RUN_COMMANDS"
    words = shlex.split(command)
    env = subprocess_env()
    while ENV_ASSIGNMENT.match(words[0]):
        key, value = words.pop(0).split("=", 1)
        env[key] = value
    if words[0] == "torchrun":
        words = [sys.executable, "-m", "torch.distributed.run", *words[1:]]
    elif PYTHON_WORD.match(words[0]):
        words = [sys.executable, *words[1:]]
    result = subprocess.run(words, cwd=REPO, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, f"{where}: {command}\n{result.stdout[-2000:]}\n" \
                                   f"{result.stderr[-4000:]}"
    for expected in RUN_COMMANDS[where, command]:
        assert expected in result.stdout, f"{where}: {command}: no {expected!r}\n" \
                                          f"{result.stdout[-2000:]}"


YAML_BLOCKS = [b for b in ALL_BLOCKS if b.lang == "yaml"]


@pytest.mark.parametrize("block", YAML_BLOCKS, ids=[b.where for b in YAML_BLOCKS])
def test_yaml_blocks_load(block, tmp_path):
    """Valid YAML; an Accelerate config file loads with Accelerate's own loader."""
    import yaml

    config = yaml.safe_load(block.code)
    if isinstance(config, dict) and "compute_environment" in config:
        from accelerate.commands.config.config_args import ClusterConfig

        (tmp_path / "config.yaml").write_text(block.code)
        loaded = ClusterConfig.from_yaml_file(tmp_path / "config.yaml")
        assert loaded.to_dict()["num_machines"] == config["num_machines"]


def test_accelerate_config_check_can_fail(tmp_path):
    from accelerate.commands.config.config_args import ClusterConfig

    (tmp_path / "config.yaml").write_text("compute_environment: LOCAL_MACHINE\n"
                                          "distributed_type: MULTI_GPU\nnum_machine: 2\n")
    with pytest.raises(ValueError, match="num_machine"):
        ClusterConfig.from_yaml_file(tmp_path / "config.yaml")


# ---------------------------------------------------------------- python blocks

PYTHON_DRIVER = r"""
import json, sys
blocks = json.load(open(sys.argv[1]))
namespace = {"__name__": "__main__"}
for block in blocks:
    # leading newlines make tracebacks show the markdown file's own line numbers
    code = compile("\n" * (block["line"] - 1) + block["code"], block["path"], "exec")
    print(f"--- running {block['path']}:{block['line']}", flush=True)
    exec(code, namespace)
"""


def python_blocks(path: Path) -> list[Block]:
    return [b for b in ALL_BLOCKS if b.path == path and b.lang == "python"]


def is_launcher_script(block: Block) -> bool:
    return TORCHRUN_MARK.match(block.code.split("\n", 1)[0]) is not None


PYTHON_FILES = [p for p in DOC_FILES
                if any(not is_launcher_script(b) for b in python_blocks(p))]
LAUNCHER_BLOCKS = [b for b in ALL_BLOCKS if b.lang == "python" and is_launcher_script(b)]
SLOW_FILES: set[str] = set()  # names of files whose blocks take over ~20 s (none: at most 14 s)


@pytest.mark.parametrize("path", [
    pytest.param(p, marks=[pytest.mark.slow] if rel(p) in SLOW_FILES else [],
                 id=rel(p)) for p in PYTHON_FILES])
def test_python_blocks_run(path, tmp_path, fork_server):
    """The file's python blocks, in order, in one namespace, in a fresh process."""
    blocks = [{"path": str(b.path), "line": b.line, "code": b.code}
              for b in python_blocks(path) if not is_launcher_script(b)]
    (tmp_path / "blocks.json").write_text(json.dumps(blocks))
    work = tmp_path / "work"
    work.mkdir()
    code, output = fork_server(PYTHON_DRIVER, ["<docs driver>", str(tmp_path / "blocks.json")],
                               cwd=work, timeout=300)
    assert code == 0, f"{rel(path)} failed:\n{output[-8000:]}"


GLOO_TEARDOWN_ABORT = "terminate called without an active exception"


@pytest.mark.slow  # two processes under torchrun: 14-17 s on two busy cores
@pytest.mark.parametrize("block", LAUNCHER_BLOCKS, ids=[b.where for b in LAUNCHER_BLOCKS])
def test_launcher_scripts_run(block, tmp_path):
    """A whole-script block, under ``torch.distributed.run`` with the ranks it names."""
    nproc = TORCHRUN_MARK.match(block.code.split("\n", 1)[0]).group(1)
    script = tmp_path / "snippet.py"
    script.write_text("\n" * (block.line - 1) + block.code)
    for _attempt in range(2):
        result = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
             nproc, str(script)], cwd=tmp_path, env=subprocess_env(), capture_output=True,
            text=True, timeout=300)
        # torch's gloo teardown on CPU aborts a process now and then (about 1 run in 8 of the
        # FSDP2 blocks, at every revision tried): that one signature is run once more
        if result.returncode == 0 or GLOO_TEARDOWN_ABORT not in result.stderr:
            break
    assert result.returncode == 0, f"{block.where} failed:\n{result.stdout[-3000:]}\n" \
                                   f"{result.stderr[-6000:]}"


def test_every_python_block_is_run():
    ran = {id(b) for p in PYTHON_FILES for b in python_blocks(p) if not is_launcher_script(b)}
    ran |= {id(b) for b in LAUNCHER_BLOCKS}
    assert all(id(b) in ran for b in ALL_BLOCKS if b.lang == "python")


# ---------------------------------------------------------------- links


def github_slug(heading: str) -> str:
    text = heading.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    slugs, seen, in_fence = set(), {}, False
    for line in path.read_text().split("\n"):
        if re.match(r"^\s*```", line):
            in_fence = not in_fence
        elif not in_fence and (m := re.match(r"^#{1,6}\s+(.*)$", line)):
            slug = github_slug(m.group(1))
            count = seen.get(slug, 0)
            seen[slug] = count + 1
            slugs.add(slug if count == 0 else f"{slug}-{count}")
    return slugs


def test_relative_links_resolve():
    broken = []
    for path in [*DOC_FILES, REPO / "BENCHMARKS.md", *sorted(REPO.glob("*/README.md")),
                 *sorted((REPO / "docs" / "benchmarks").glob("*.md"))]:
        text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"^[a-z]+:", target):
                continue
            file_part, _, anchor = target.partition("#")
            resolved = (path.parent / file_part).resolve() if file_part else path
            if not resolved.exists():
                broken.append(f"{rel(path)}: {target} (no such file)")
            elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
                broken.append(f"{rel(path)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


# ---------------------------------------------------------------- the front page

README_MAX_LINES = 150
TRAINER_EXAMPLE_BEFORE_LINE = 60


def test_the_readme_is_a_front_page():
    """README.md is read first: at most 150 lines, and the Hugging Face Trainer example
    (``TrainingArguments(optim="distributed_shampoo")``, a python block that runs) before line
    60. Compatibility, results and the details of each feature live on the pages it links to."""
    readme = REPO / "README.md"
    n_lines = len(readme.read_text().splitlines())
    assert n_lines <= README_MAX_LINES, (
        f"README.md has {n_lines} lines (at most {README_MAX_LINES}): move the details to "
        "docs/ or BENCHMARKS.md and link them")
    trainer_lines = [block.line + offset for block in python_blocks(readme)
                     if "TrainingArguments(" in block.code
                     for offset, line in enumerate(block.code.split("\n"))
                     if 'optim="distributed_shampoo"' in line.split("#", 1)[0]]
    assert trainer_lines, \
        'README.md has no python block with TrainingArguments(optim="distributed_shampoo")'
    assert trainer_lines[0] < TRAINER_EXAMPLE_BEFORE_LINE, (
        f"the Trainer example's optim=\"distributed_shampoo\" is on README.md:{trainer_lines[0]}, "
        f"not before line {TRAINER_EXAMPLE_BEFORE_LINE}")
