"""Type checkers see the keywords: mypy, run on a small file of calls, flags a keyword of
the wrong type and a misspelt one, in ``DistributedShampoo(...)`` and in
``make_optimizer(...)``, and accepts correct calls (the signature is generated from the
keyword table: docs/design.md §7). At run time an unknown keyword still raises the
package's ``TypeError``, with the closest valid names."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest
import torch

from hf_shampoo import DistributedShampoo

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]

CALLS = """\
import torch

from hf_shampoo import DistributedShampoo, make_optimizer

p = [torch.nn.Parameter(torch.zeros(2, 2))]
model = torch.nn.Linear(2, 2)
DistributedShampoo(p, max_preconditioner_dim="x")  # line 7: wrong type
DistributedShampoo(p, max_precondtioner_dim=8)  # line 8: misspelt
make_optimizer(model, max_preconditioner_dim="x")  # line 9: wrong type
make_optimizer(model, max_precondtioner_dim=8)  # line 10: misspelt
DistributedShampoo(p, 0.1, (0.9, 0.999), max_preconditioner_dim=8, grafting="adam",
                   factor_matrix_dtype=torch.float64, compile={"backend": "eager"},
                   inverse_exponent_override={2: {0: 0.0}}, process_group=None)
DistributedShampoo(p, lr=torch.tensor(0.01), beta3=None, epsilon=1e-8)
make_optimizer(model, "transformer", lr=1e-3, grafting=None, max_preconditioner_dim=64)
settings: dict = {"lr": 0.1}
DistributedShampoo(p, **settings)
"""
# what mypy says on each flagged line (fragments: the wording is mypy's)
EXPECTED = {
    7: ('"max_preconditioner_dim"', '"DistributedShampoo"', 'incompatible type "str"',
        'expected "int"'),
    8: ('Unexpected keyword argument "max_precondtioner_dim"', '"DistributedShampoo"'),
    9: ('"max_preconditioner_dim"', '"make_optimizer"', 'incompatible type "str"',
        'expected "int"'),
    10: ('Unexpected keyword argument "max_precondtioner_dim"', '"make_optimizer"'),
}


def assert_flagged(errors: dict[int, list[str]]) -> None:
    """One error on each line of ``EXPECTED``, saying that, and none elsewhere."""
    assert sorted(errors) == sorted(EXPECTED), errors
    for line, fragments in EXPECTED.items():
        assert len(errors[line]) == 1, errors[line]
        assert all(f in errors[line][0] for f in fragments), (errors[line][0], fragments)


def run_mypy(tmp_path: Path, follow_torch: bool) -> dict[int, list[str]]:
    """mypy's errors on ``CALLS``, by line. hf_shampoo is this checkout's (``mypy_path``),
    analysed but not reported (``silent``); without ``follow_torch`` every other module is
    skipped (``Any``: a second), with it torch is analysed too (half a minute cold)."""
    api = pytest.importorskip("mypy.api", reason="mypy is not installed (pip install mypy, "
                                                 "or the dev extra)")
    (tmp_path / "calls.py").write_text(CALLS)
    follow = "silent" if follow_torch else "skip"
    (tmp_path / "mypy.ini").write_text(textwrap.dedent(f"""\
        [mypy]
        mypy_path = {ROOT}
        follow_imports = {follow}
        ignore_missing_imports = True
        [mypy-hf_shampoo.*]
        follow_imports = silent
        """))
    out, err, status = api.run([
        "--config-file", str(tmp_path / "mypy.ini"), "--no-incremental",
        "--cache-dir", str(tmp_path / "cache"), "--no-error-summary", "--hide-error-context",
        str(tmp_path / "calls.py")])
    assert status in (0, 1) and not err, (status, out, err)
    errors: dict[int, list[str]] = {}
    for line in out.splitlines():
        match = re.match(r".*calls\.py:(\d+): error: (.*?)(?:  \[[\w-]+\])?$", line)
        assert match or ": note: " in line, line  # nothing but errors on the calls
        if match:
            errors.setdefault(int(match.group(1)), []).append(match.group(2))
    return errors


def test_mypy_flags_wrong_and_misspelt_keywords(tmp_path):
    assert_flagged(run_mypy(tmp_path, follow_torch=False))


@pytest.mark.slow
def test_mypy_flags_them_with_torch_analysed(tmp_path):
    """The same with torch's types (``torch.dtype``, ``Tensor``, ``ProcessGroup``) real."""
    assert_flagged(run_mypy(tmp_path, follow_torch=True))


def test_an_unknown_keyword_still_raises_the_packages_type_error():
    w = torch.nn.Parameter(torch.zeros(3, 3))
    with pytest.raises(TypeError, match=r"DistributedShampoo\(\): unknown keyword argument\(s\) "
                       r"'max_precondtioner_dim' \(did you mean 'max_preconditioner_dim'\?\); "
                       r"valid keywords are params, lr, betas"):
        DistributedShampoo([w], max_precondtioner_dim=8)
    with pytest.raises(ValueError, match="invalid max_preconditioner_dim='x'"):
        DistributedShampoo([w], max_preconditioner_dim="x")


def test_the_arguments_become_the_defaults():
    """Every keyword reaches ``defaults`` under its name; lists of pairs become tuples."""
    from hf_shampoo import config

    w = torch.nn.Parameter(torch.zeros(3, 3))
    assert DistributedShampoo([w]).defaults == config.DEFAULTS
    opt = DistributedShampoo([w], 0.5, [0.8, 0.9], max_preconditioner_dim=2,
                             newton_schulz_coefficients=[3.0, -4.0, 2.0], sketch_rank=4)
    expected = {**config.DEFAULTS, "lr": 0.5, "betas": (0.8, 0.9), "max_preconditioner_dim": 2,
                "newton_schulz_coefficients": (3.0, -4.0, 2.0), "sketch_rank": 4}
    assert opt.defaults == expected
    assert list(opt.defaults) == list(config.DEFAULTS)
