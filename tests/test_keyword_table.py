"""The keyword table (``hf_shampoo.config.TABLE``) is the one source of the keywords: the
defaults, the constructor's signature, validation, ``optim_args`` types, the scopes and
docs/keywords.md all agree with it, and the kinds own their rows (docs/design.md §7)."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest
import torch

from hf_shampoo import DistributedShampoo, config
from hf_shampoo.integrations.transformers.arguments import cast_value, parse_optim_args
from hf_shampoo.preconditioners import KINDS
from hf_shampoo.preconditioners.base import KroneckerFactored

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]


def test_docs_keywords_md_is_the_table():
    text = (ROOT / "docs" / "keywords.md").read_text(encoding="utf-8")
    start = text.index(config._DOCS_BEGIN) + len(config._DOCS_BEGIN) + 1
    end = text.index(config._DOCS_END)
    assert text[start:end] == config.keyword_reference(), (
        "docs/keywords.md disagrees with the keyword table: run `python -m hf_shampoo.config`")


def test_signature_is_the_table():
    """The table's keywords, then ``process_group`` (keyword only, not a hyperparameter:
    it is not saved with the groups): names, kinds, defaults and annotations are the
    table's (``config.signature()``)."""
    parameters = list(inspect.signature(DistributedShampoo).parameters.values())
    assert parameters[0].name == "params"
    assert [p.name for p in parameters[1:]] == [*config.TABLE, "process_group"]
    assert parameters[-1].kind is inspect.Parameter.KEYWORD_ONLY
    assert parameters[-1].default is None and "process_group" not in config.DEFAULTS
    parameters = parameters[:-1]
    for p in parameters[1:]:
        assert p.default == config.DEFAULTS[p.name]
        assert type(p.default) is type(config.DEFAULTS[p.name]), p.name
        positional = p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
        assert positional == (p.name in config.POSITIONAL), p.name
    assert list(config.POSITIONAL) == list(config.TABLE)[:len(config.POSITIONAL)]
    assert parameters == list(config.signature().parameters.values())


def test_generated_signature_is_current():
    """optimizer.py's generated blocks (the constructor's keywords, ``ShampooKeywords``)
    are what ``python -m hf_shampoo.config`` writes from the table now."""
    text = (ROOT / "hf_shampoo" / "optimizer.py").read_text(encoding="utf-8")
    assert config.generated_source(text) == text, (
        "hf_shampoo/optimizer.py's signature disagrees with the keyword table: run "
        "`python -m hf_shampoo.config`")


def test_make_optimizer_keywords_are_the_table():
    """``make_optimizer``'s ``**keywords`` are typed by ``ShampooKeywords``: every keyword
    of the table, then ``process_group``, none required, annotated as the constructor's."""
    from hf_shampoo import make_optimizer
    from hf_shampoo.optimizer import ShampooKeywords

    assert list(ShampooKeywords.__annotations__) == [*config.TABLE, "process_group"]
    assert not ShampooKeywords.__required_keys__
    keywords = inspect.signature(make_optimizer).parameters["shampoo_kwargs"]
    assert keywords.kind is inspect.Parameter.VAR_KEYWORD
    assert keywords.annotation == "Unpack[ShampooKeywords]"


def test_the_generated_source_renders_every_default():
    """Each default written into the signature reads back as the table's value."""
    namespace = {"torch": torch}
    for name, row in config.TABLE.items():
        source = next(line for line in config.signature_source()["parameters"]
                      if line.startswith(f"{name}:"))
        value = eval(source.split(" = ", 1)[1].rstrip(","), namespace)
        assert value == row.default and type(value) is type(row.default), name


def test_switches_are_keyword_only():
    w = torch.nn.Parameter(torch.zeros(3, 3))
    DistributedShampoo([w], 0.1, (0.9, 0.999), None, 1e-12, 0.0, 0.0, False, 0.0)
    with pytest.raises(TypeError):
        DistributedShampoo([w], 0.1, (0.9, 0.999), None, 1e-12, 0.0, 0.0, False, 0.0,
                           "decoupled")


def test_defaults_scopes_and_rows_agree():
    assert config.DEFAULTS == {name: row.default for name, row in config.TABLE.items()}
    for row in config.TABLE.values():
        row.validate(row.default)
        assert row.doc
    config.validate_group(dict(config.DEFAULTS))
    assert set(config.GLOBAL_KEYS) >= {"distributed", "compile", "check_finite_gradients"}
    assert config.RUNTIME_KEYS == ("compile",)
    assert {"preconditioner", "quantization", "experts"} <= set(config.LAYOUT_KEYS)


@pytest.mark.parametrize("name", list(config.TABLE))
def test_optim_args_casts_to_the_rows_type(name):
    row = config.TABLE[name]
    default = row.default
    if default is None:
        assert cast_value(name, "none") is None
        return
    if isinstance(default, tuple):
        text = "(" + ";".join(map(str, default)) + ")"
    elif isinstance(default, torch.dtype):
        text = str(default).removeprefix("torch.")
    else:
        text = str(default)
    assert cast_value(name, text) == default
    assert parse_optim_args(f"{name}={text}").kwargs[name] == default


def test_kinds_own_their_rows():
    common = {row.name for row in config.COMMON_KEYWORDS}
    for name, kind in KINDS.items():
        for row in kind.own_keywords():
            assert config.TABLE[row.name] is row
            assert row.name not in common
            assert name in config.KIND_KEYWORDS[row.name]
    assert set(config.KIND_KEYWORDS["sign_scale"]) == {"sign_descent"}
    assert "shampoo" in config.KIND_KEYWORDS["root_inverse"]


def test_no_kind_name_is_branched_on_outside_the_kinds():
    """Outside preconditioners/, code asks the kind (``KINDS[name].refreshes`` ...), never
    compares a group's kind with a name."""
    names = "|".join(KINDS)
    pattern = re.compile(r"""(==|!=|\bin)\s*\(?\s*["'](""" + names + r""")["']""")
    for path in ["config.py", "step.py", "optimizer.py", *(
            str(p.relative_to(ROOT / "hf_shampoo"))
            for p in (ROOT / "hf_shampoo" / "integrations").rglob("*.py"))]:
        text = (ROOT / "hf_shampoo" / path).read_text(encoding="utf-8")
        assert not pattern.search(text), (path, pattern.search(text).group(0))


def test_a_new_kind_is_one_module_and_one_registry_line(monkeypatch):
    """docs/design.md §7's worked example: a kind with one keyword of its own."""
    from hf_shampoo.keywords import Keyword, real

    class Damped(KroneckerFactored):
        name = "damped_shampoo"
        keywords = (Keyword("damping", 0.0, float, real(0.0), doc="ridge of the factors"),)

    monkeypatch.setitem(KINDS, "damped_shampoo", Damped())
    table = config._join(config.COMMON_KEYWORDS)
    assert table["damping"].default == 0.0
    group = {**{n: r.default for n, r in table.items()}, "preconditioner": "damped_shampoo"}
    assert Damped().acts("damping", group, frozenset({"damping"}))
    assert not KINDS["shampoo"].acts("damping", group, frozenset({"damping"}))
