"""Every environment variable the package reads is declared once in mla_backend_plugin/envs.py, parsed one way,
and documented in docs/environment.md by the table envs.py prints."""

from __future__ import annotations

import pathlib
import re

import pytest

from mla_backend_plugin import envs

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_every_variable_read_in_the_package_is_declared():
    """No module reads a CUTE_MLA_* variable behind envs.py's back: every name the sources spell is declared,
    and only envs.py touches os.environ for them."""
    spelled = set()
    for path in (ROOT / "mla_backend_plugin").rglob("*.py"):
        text = path.read_text()
        spelled |= set(re.findall(r"\b(CUTE_MLA_[A-Z0-9_]+)\b", text))
        if path.name != "envs.py":
            reads = (r"os\.(?:environ\.get|getenv)\(\s*[\"'](CUTE_MLA_\w+)",  # writes (os.environ[X] = ...) are fine
                     r"os\.environ\[\s*[\"'](CUTE_MLA_\w+)[\"']\](?!\s*=[^=])")
            for m in (m for pattern in reads for m in re.finditer(pattern, text)):
                pytest.fail(f"{path.relative_to(ROOT)} reads {m.group(1)} directly; use envs.py")
    assert spelled <= set(envs.VARIABLES), sorted(spelled - set(envs.VARIABLES))


def test_readme_table_is_the_generated_one():
    """The documented table (docs/environment.md, linked from README.md) is envs.py's output."""
    doc = (ROOT / "docs" / "environment.md").read_text()
    assert envs.markdown_table() in doc, "docs/environment.md is stale: paste `python -m mla_backend_plugin.envs`"


def test_one_parser(monkeypatch):
    for v in ("0", "false", "OFF", "no"):
        monkeypatch.setenv("CUTE_MLA_PDL", v)
        assert envs.CUTE_MLA_PDL is False
    for v in ("1", "true", "On", "yes"):
        monkeypatch.setenv("CUTE_MLA_PDL", v)
        assert envs.get("CUTE_MLA_PDL") is True
    monkeypatch.setenv("CUTE_MLA_PDL", "")
    assert envs.CUTE_MLA_PDL is True  # empty = unset = the default
    monkeypatch.setenv("CUTE_MLA_PDL", "2")
    with pytest.raises(ValueError, match=r"CUTE_MLA_PDL='2': allowed values are 1, true, on, yes, 0"):
        _ = envs.CUTE_MLA_PDL
    monkeypatch.setenv("CUTE_MLA_SELF_CHECK", "ALWAYS")
    assert envs.CUTE_MLA_SELF_CHECK == "always"
    monkeypatch.setenv("CUTE_MLA_SELF_CHECK", "sometimes")
    with pytest.raises(ValueError, match="CUTE_MLA_SELF_CHECK='sometimes': allowed values are auto, always, never"):
        _ = envs.CUTE_MLA_SELF_CHECK
    monkeypatch.setenv("CUTE_MLA_CUTE_CACHE", "off")
    assert envs.CUTE_MLA_CUTE_CACHE is None
    monkeypatch.setenv("CUTE_MLA_CUTE_CACHE", "~/x")
    assert envs.CUTE_MLA_CUTE_CACHE.endswith("/x") and not envs.CUTE_MLA_CUTE_CACHE.startswith("~")
    monkeypatch.delenv("CUTE_MLA_KERNEL", raising=False)
    assert envs.CUTE_MLA_KERNEL == "auto"
    with pytest.raises(AttributeError):
        _ = envs.CUTE_MLA_NOT_A_VARIABLE
    with pytest.raises(KeyError, match="not a declared variable"):
        envs.get("CUTE_MLA_NOT_A_VARIABLE")
