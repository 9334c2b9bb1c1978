"""What the distribution promises: one version everywhere, a license, torch as the only hard
requirement, extras that hold what their integrations import, the floors the compatibility
table (docs/compatibility.md) and ``make floors`` use, ``py.typed`` and a typed public API,
and a wheel and an sdist that carry all of it (built here from a copy of the sources).
"""

from __future__ import annotations

import email
import inspect
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

import hf_shampoo
from hf_shampoo.optional import EXTRAS

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]
PYPROJECT = (REPO / "pyproject.toml").read_text()


def table(name: str) -> str:
    """The text of one ``[name]`` table of pyproject.toml (read by hand: tomllib is 3.11+)."""
    found = re.search(rf"^\[{re.escape(name)}\]\n(.*?)(?=^\[|\Z)", PYPROJECT, flags=re.M | re.S)
    assert found, name
    return found.group(1)


def string_list(text: str, key: str) -> list[str]:
    found = re.search(rf"^{re.escape(key)}\s*=\s*\[(.*?)\]", text, flags=re.M | re.S)
    assert found, key
    return re.findall(r'"([^"]+)"', re.sub(r"#.*", "", found.group(1)))


def requirement_name(requirement: str) -> str:
    return re.match(r"[A-Za-z0-9_.-]+", requirement).group(0).lower()


def floors(requirements: list[str]) -> dict[str, str]:
    """{name: X} for every ``name>=X`` among ``requirements``."""
    return {requirement_name(r): m.group(1) for r in requirements
            if (m := re.search(r">=\s*([0-9][^,;\s]*)", r))}


PROJECT = table("project")
DEPENDENCIES = string_list(PROJECT, "dependencies")
EXTRA_LISTS = {name: string_list(table("project.optional-dependencies"), name)
               for name in re.findall(r"^([A-Za-z0-9_-]+)\s*=",
                                      re.sub(r"#.*", "", table("project.optional-dependencies")),
                                      flags=re.M)}


def test_one_version():
    version = re.search(r'^version\s*=\s*"([^"]+)"', PROJECT, flags=re.M).group(1)
    assert hf_shampoo.__version__ == version
    changelog = (REPO / "CHANGELOG.md").read_text()
    assert re.search(rf"^## {re.escape(version)} — \d{{4}}-\d\d-\d\d$", changelog, flags=re.M)


def test_license():
    assert re.search(r'^license\s*=\s*"Apache-2.0"', PROJECT, flags=re.M)
    assert string_list(PROJECT, "license-files") == ["LICENSE", "NOTICE"]
    text = (REPO / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text and len(text.splitlines()) > 200
    assert "Copyright 2026 The hf_shampoo authors" in (REPO / "NOTICE").read_text()


def test_torch_is_the_only_hard_requirement():
    assert [requirement_name(r) for r in DEPENDENCIES] == ["torch"]


def test_extras_hold_what_their_integrations_import():
    """Each library ``hf_shampoo.optional`` names is in the extra its message names; ``all``
    holds every extra but ``dev``, and ``dev`` holds ``all`` and the test tools."""
    names = {extra: {requirement_name(r) for r in reqs} for extra, reqs in EXTRA_LISTS.items()}
    for module, (distribution, extra) in EXTRAS.items():
        assert distribution.lower() in names[extra], (module, extra)
    others = set().union(*(v for k, v in names.items() if k not in ("all", "dev")))
    assert others <= names["all"], others - names["all"]
    assert names["all"] | {"pytest", "ruff", "expecttest"} <= names["dev"]
    assert {"transformers", "accelerate"} <= names["transformers"]
    assert {"timm", "torchvision"} <= names["timm"]


def test_every_extra_has_the_same_floor_for_a_library():
    seen: dict[str, set[str]] = {}
    for requirements in [DEPENDENCIES, *EXTRA_LISTS.values()]:
        for name, floor in floors(requirements).items():
            seen.setdefault(name, set()).add(floor)
    assert {name: v for name, v in seen.items() if len(v) > 1} == {}


def test_the_floor_check_installs_the_floors():
    """tools/floors.txt pins every floor of pyproject.toml (``>=X`` there, ``==X`` here) and
    pins nothing the project does not floor, but torchvision (timm's, paired with torch)."""
    pins = dict(re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)",
                           (REPO / "tools" / "floors.txt").read_text(), flags=re.M))
    declared = floors([*DEPENDENCIES, *EXTRA_LISTS["all"]])
    assert {k: v for k, v in pins.items() if k != "torchvision"} == {
        k: v if v.count(".") >= 2 else f"{v}.0" for k, v in declared.items()}
    python = re.search(r'^requires-python\s*=\s*">=(\d+\.\d+)"', PROJECT, flags=re.M).group(1)
    assert f"python{python}" in (REPO / "tools" / "floors.sh").read_text()


def test_the_compatibility_table_lists_the_floors():
    """docs/compatibility.md's table has a row for every floor, at that version."""
    page = (REPO / "docs" / "compatibility.md").read_text()
    section = page[page.index("## Tested versions"):]
    declared = floors([*DEPENDENCIES, *EXTRA_LISTS["all"]])
    python = re.search(r'^requires-python\s*=\s*">=(\d+\.\d+)"', PROJECT, flags=re.M).group(1)
    for name, floor in {**declared, "python": python}.items():
        row = next((line for line in section.splitlines()
                    if line.lower().startswith(f"| {name} |")), None)
        assert row is not None, name
        assert floor in row, (name, floor, row)


def test_the_public_api_is_annotated():
    """py.typed ships, and every public name's parameters and returns carry annotations."""
    assert (REPO / "hf_shampoo" / "py.typed").exists()
    assert '"py.typed"' in table("tool.setuptools.package-data")
    missing = []

    def check(where: str, function) -> None:
        signature = inspect.signature(function)
        missing.extend(f"{where}({name})" for name, p in signature.parameters.items()
                       if name not in ("self", "cls") and p.annotation is p.empty)
        if signature.return_annotation is signature.empty and where.split(".")[-1] != "__init__":
            missing.append(f"{where} -> ?")

    for name in hf_shampoo.__all__:
        obj = getattr(hf_shampoo, name)
        if not inspect.isclass(obj):
            check(name, obj)
            continue
        for attr, member in vars(obj).items():
            function = member.fget if isinstance(member, property) else getattr(
                member, "__func__", member)
            if (attr == "__init__" or not attr.startswith("_")) and inspect.isfunction(function):
                check(f"{name}.{attr}", function)
    assert missing == []


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, Path]:
    """The sdist and the wheel built from a copy of the sources (no network: the running
    interpreter's setuptools), and the wheel built again from the sdist."""
    work = tmp_path_factory.mktemp("dist")
    source = work / "source"
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(
        ".git", ".venv*", "__pycache__", "*.egg-info", "build", "dist", "outputs"))
    build_requires = re.search(r'"setuptools>=([0-9.]+)"', table("build-system")).group(1)
    pytest.importorskip("setuptools", minversion=build_requires,
                        reason=f"builds offline with this interpreter's setuptools, which must "
                               f"be >= {build_requires} (pyproject.toml's build-system)")
    out = work / "out"
    build = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
             "-w", str(out)]
    sdist = subprocess.run([sys.executable, "-c", "from setuptools import build_meta as b; "
                            f"print(b.build_sdist({str(out)!r}))"], cwd=source,
                           capture_output=True, text=True, timeout=300)
    assert sdist.returncode == 0, sdist.stderr[-3000:]
    sdist_path = out / sdist.stdout.strip().splitlines()[-1]
    unpacked = work / "unpacked"
    with tarfile.open(sdist_path) as archive:
        archive.extractall(unpacked, filter="data")
    from_sdist = subprocess.run([*build[:-1], str(work / "from_sdist"),
                                 str(next(unpacked.iterdir()))],
                                capture_output=True, text=True, timeout=300)
    assert from_sdist.returncode == 0, from_sdist.stderr[-3000:]
    return {"sdist": sdist_path, "wheel": next((work / "from_sdist").glob("*.whl"))}


def test_the_wheel_carries_the_license_the_types_and_one_requirement(built):
    with zipfile.ZipFile(built["wheel"]) as wheel:
        names = wheel.namelist()
        info = next(n for n in names if n.endswith(".dist-info/METADATA"))
        metadata = email.message_from_string(wheel.read(info).decode())
    assert "hf_shampoo/py.typed" in names and "hf_shampoo/optional.py" in names
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    assert any(n.endswith(".dist-info/licenses/NOTICE") for n in names)
    assert not any(n.startswith(("tests/", "benchmarks/", "examples/")) for n in names)
    assert metadata["Version"] == hf_shampoo.__version__
    assert metadata["License-Expression"] == "Apache-2.0"
    unconditional = [r for r in metadata.get_all("Requires-Dist") if "extra ==" not in r]
    assert [requirement_name(r) for r in unconditional] == ["torch"]
    assert set(metadata.get_all("Provides-Extra")) == set(EXTRA_LISTS)
    assert "Typing :: Typed" in metadata.get_all("Classifier")


def test_the_sdist_carries_the_docs_tests_and_license(built):
    with tarfile.open(built["sdist"]) as archive:
        names = {n.split("/", 1)[1] for n in archive.getnames() if "/" in n}
    assert {"LICENSE", "NOTICE", "README.md", "CHANGELOG.md", "pyproject.toml",
            "hf_shampoo/py.typed", "tests/test_packaging.py", "docs/keywords.md",
            "tools/floors.sh"} <= names
