"""An AMD EPYC's libraries on any x86-64 machine: Python under ``qemu-x86_64 -cpu EPYC-Milan``.

MKL, torch's BLAS and LAPACK on x86-64, picks its code path from the CPU's ``CPUID``: on an
Intel CPU its AVX-512 or AVX2 kernels, on an AMD one a generic path ("Intel(R) Architecture
processors" in ``MKL_VERBOSE``'s banner) that batches some products differently. That is
why an AMD EPYC found stack-dependent bits that a Xeon's default kernels never showed
(issue 53). qemu's user-mode emulator (Debian's ``qemu-user``) runs this machine's Python
with the ``CPUID`` of an AMD EPYC (Milan: AVX2, no AVX-512, which qemu does not emulate), so
MKL and ATen choose exactly the kernels they choose on such a CPU; only the speed is not
the EPYC's (qemu translates every instruction: a few times slower, and some 18 s to import
torch).

    python -m benchmarks.emulated_cpu /tmp/epyc        # writes /tmp/epyc/bin/python
    /tmp/epyc/bin/python -m pytest tests/test_kronecker.py   # the tests on the EPYC's path

``python`` written here is an interpreter of its own (a small virtual environment over this
one's packages), so that ``sys.executable`` is the emulated one and every process a test
starts (ranks, ``torchrun``) runs emulated too. ``make test-emulated-epyc`` runs the tests
that compare bits across stacks, layouts and processes that way.
"""

from __future__ import annotations

import argparse
import functools
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

from benchmarks.common import cpuinfo

#: qemu's model of an AMD EPYC 7003 (Milan, Zen 3)
MODEL = "EPYC-Milan-v1"

INSTALL = "apt-get install qemu-user"

#: set in every emulated process: the model it runs as
ACTIVE = "HF_SHAMPOO_EMULATED_CPU"


def active() -> str | None:
    """The model this process runs as, where it is emulated."""
    return os.environ.get(ACTIVE)


def host_vendor() -> str:
    """The vendor of the machine's CPU (``GenuineIntel``, ``AuthenticAMD``; "" if unknown):
    ``/proc/cpuinfo``, which qemu's user mode leaves the host's."""
    return cpuinfo("vendor_id")


def qemu() -> str | None:
    """``qemu-x86_64``'s path where it can run this machine's Python, else ``None``."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return None
    return shutil.which("qemu-x86_64")


@functools.cache
def cpu_argument(model: str = MODEL) -> str:
    """``-cpu``'s value: ``model`` less the features qemu's translator cannot give (it says
    so on every start otherwise, on the standard error a test may read)."""
    probe = subprocess.run([qemu() or "qemu-x86_64", "-cpu", model, "/bin/true"],
                           capture_output=True, text=True, check=True)
    missing = re.findall(r"CPUID[^ ]*\.([\w-]+) \[bit", probe.stderr)
    return ",".join([model, *(f"-{feature}" for feature in dict.fromkeys(missing))])


def launcher(model: str = MODEL) -> list[str]:
    """The command prefix that runs a program as on ``model``."""
    path = qemu()
    if path is None:
        raise RuntimeError(f"qemu-x86_64 is not installed on this x86-64 machine: {INSTALL}")
    # torch.compile's C++ is built by the host's compiler, natively: for the emulated CPU's
    # instructions (x86-64-v3: AVX2, FMA), not the host's (-march=native: AVX-512 here)
    return [path, "-cpu", cpu_argument(model), "-E", f"{ACTIVE}={model}",
            "-E", "TORCHINDUCTOR_CPP_MARCH=x86-64-v3"]


def _binary() -> Path:
    """This interpreter's own binary (qemu runs binaries only: not a virtual environment's
    link, nor the script ``write_python`` writes)."""
    return Path(getattr(sys, "_base_executable", sys.executable)).resolve()


def python_command(model: str = MODEL, name: str | None = None) -> list[str]:
    """The command that runs this interpreter as on ``model``: its binary, named as ``name``
    (``sys.executable`` by default) so that the environment there is found (also from
    inside an emulated one)."""
    return [*launcher(model), "-0", name or sys.executable, str(_binary())]


def _link(link: Path, target) -> None:
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(target)


def write_python(directory: Path, model: str = MODEL) -> Path:
    """Write ``directory/bin/python``: this interpreter, with this environment's packages,
    run as on ``model``. Returns its path."""
    directory = Path(directory).resolve()
    base = _binary()
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    in_venv = sys.prefix != sys.base_prefix
    (directory / "bin").mkdir(parents=True, exist_ok=True)
    (directory / "pyvenv.cfg").write_text(
        f"home = {base.parent}\n"
        f"include-system-site-packages = {'false' if in_venv else 'true'}\n"
        f"version = {platform.python_version()}\n")
    if in_venv:  # this environment's packages, the editable hf_shampoo included
        packages = directory / "lib" / version / "site-packages"
        packages.parent.mkdir(parents=True, exist_ok=True)
        _link(packages, sysconfig.get_paths()["purelib"])
    python = directory / "bin" / "python"
    command = shlex.join(python_command(model, str(python)))
    python.write_text("#!/bin/sh\n"
                      f"# {base} as on an AMD {model} (benchmarks/emulated_cpu.py)\n"
                      f'exec {command} "$@"\n')
    python.chmod(0o755)
    for alias in ("python3", version):
        _link(directory / "bin" / alias, "python")
    return python


SEEN = """
import torch
a = torch.ones(8, 8)
a @ a
print("ATen kernels:", torch.backends.cpu.get_cpu_capability())
"""


def mkl_path(output: str) -> str:
    """The code path MKL names in the first ``MKL_VERBOSE`` banner of a process's output,
    else ""."""
    for line in output.splitlines():
        if line.startswith("MKL_VERBOSE") and " for " in line and ", Lnx" in line:
            return line.split(" for ", 1)[1].split(", Lnx")[0].removeprefix(
                "Intel(R) 64 architecture ")
    return ""


def what_the_libraries_see(command: list[str]) -> list[str]:
    """MKL's code path and ATen's kernel set, under ``command``."""
    out = subprocess.run([*command, "-c", SEEN], capture_output=True, text=True, check=True,
                         env={**os.environ, "MKL_VERBOSE": "1"}).stdout
    return [f"MKL: {mkl_path(out) or 'not used'}",
            *(line for line in out.splitlines() if line.startswith("ATen kernels:"))]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", type=Path, help="where to write bin/python")
    parser.add_argument("--model", default=MODEL, help=f"qemu's CPU model (default {MODEL})")
    args = parser.parse_args(argv)
    python = write_python(args.directory, args.model)
    print(python)
    for line in what_the_libraries_see([str(python)]):
        print("  emulated:", line)
    for line in what_the_libraries_see([sys.executable]):
        print("  this CPU:", line)


if __name__ == "__main__":
    main()
