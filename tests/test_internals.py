"""The mergekit boundary's one table (``integration/internals.py``): it matches the installed mergekit,
a moved internal fails naming the mergekit version, and the plugin uses nothing outside it."""

from __future__ import annotations

import ast
import importlib.metadata
import inspect
import os
import re
from pathlib import Path

import mergekit
import mergekit.merge
import mergekit.scripts.multimerge
import pytest

from mergekit_ram.integration.internals import INTERNALS, MergekitMovedError, check_internals, internal, mergekit_found

PACKAGE = Path(__file__).resolve().parents[1] / "mergekit_ram"


def test_every_entry_resolves_with_the_parameters_the_plugin_expects() -> None:
    check_internals()
    for entry in INTERNALS:
        value = internal(entry.module, entry.name)
        assert value is not None, entry
        if entry.parameters is not None:
            assert tuple(inspect.signature(inspect.unwrap(value)).parameters) == entry.parameters, entry


def test_a_moved_internal_fails_naming_the_version(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(mergekit.scripts.multimerge, "patched_config")
    with pytest.raises(MergekitMovedError) as moved:
        check_internals()
    version = importlib.metadata.version("mergekit")  # mergekit has no __version__
    assert mergekit_found() == f"mergekit {version} ({os.path.dirname(mergekit.__file__)})"
    # where the version found is the one tested (a source build?), pip must replace it all the same
    force = " --force-reinstall --no-deps" if version == "0.1.5" else ""
    assert str(moved.value) == (
        f"mergekit-ram cannot find mergekit.scripts.multimerge.patched_config in {mergekit_found()}; "
        "it supports mergekit>=0.1.5,<0.2 where that is unchanged (tested: 0.1.5): "
        f'pip install{force} "mergekit==0.1.5"'
    )


def test_a_resigned_internal_fails_naming_the_parameters(monkeypatch: pytest.MonkeyPatch) -> None:
    def _model_out_config(config: object, arch_info: object) -> None:
        """mergekit's helper, as a release that dropped a parameter would have it."""

    monkeypatch.setattr(mergekit.merge, "_model_out_config", _model_out_config)
    with pytest.raises(MergekitMovedError, match=r"mergekit\.merge\._model_out_config with the parameters config, "):
        internal("mergekit.merge", "_model_out_config")


def _calls(tree: ast.AST) -> list[tuple[str, str, int]]:
    """(module, name, line) of every ``internal(...)`` and ``wrap(...)`` call with literal arguments;
    calls whose first two arguments are not string literals are returned with empty names."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("internal", "wrap"):
            literal = [a.value for a in node.args[:2] if isinstance(a, ast.Constant) and isinstance(a.value, str)]
            found.append((*(literal if len(literal) == 2 else ("", "")), node.lineno))
    return found


def test_the_plugin_uses_only_what_the_table_names() -> None:
    """No module imports mergekit itself; every ``internal``/``wrap`` call names a table entry."""
    table = {(entry.module, entry.name) for entry in INTERNALS}
    unlisted, imports, used = [], [], set()
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            imports += [f"{path.name}: {name}" for name in names if name.split(".")[0] == "mergekit"]
        if path.name == "internals.py":
            continue
        for module, name, line in _calls(tree):
            if (module, name) in table:
                used.add((module, name))
                used.add((module, name.rpartition(".")[0]))  # wrap reaches a method's class, a command
            else:
                unlisted.append(f"{path.relative_to(PACKAGE)}:{line} {module}.{name}")
    assert imports == []
    assert unlisted == []
    assert table - used == set(), sorted(table - used)  # every entry is used


def test_the_touch_points_stay_few() -> None:
    """Few names of mergekit in the table (issue 29 asks for 20; 22 today) and at most 3 wraps: each is a
    place where a new mergekit release can break the plugin. No private mergekit method is overridden."""
    wraps = [
        node
        for path in sorted(PACKAGE.rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "wrap"
    ]
    assert len(INTERNALS) <= 22
    assert len(wraps) <= 3
    from mergekit_ram.integration.methods import RamMergeMethod

    private = [name for name, value in vars(RamMergeMethod).items() if callable(value) and re.match(r"_[^_]", name)]
    assert [name for name in private if any(hasattr(base, name) for base in RamMergeMethod.__mro__[1:])] == []
