"""The layers: only ``mergekit_ram/integration/`` touches mergekit; everything else works without it."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "mergekit_ram"
BOUNDARY = PACKAGE / "integration"

#: The plain modules on top, which may reach the boundary when a command or function is used.
TOP = ("mergekit_ram/__init__.py", "mergekit_ram/_autoload.py", "mergekit_ram/cli.py", "mergekit_ram/probe.py")

#: A meta-path finder that makes ``mergekit`` (and its submodules) unimportable.
BLOCK_MERGEKIT = """
import sys
class _NoMergekit:
    def find_spec(self, name, path=None, target=None):
        if name == "mergekit" or name.startswith("mergekit."):
            raise ModuleNotFoundError(f"No module named {name!r} (blocked by tests/test_layers.py)")
        return None
sys.meta_path.insert(0, _NoMergekit())
"""


def imported_modules(path: Path) -> set[str]:
    """Every module a file imports, at the top or deferred inside functions."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
    return found


def plain_modules() -> list[Path]:
    return sorted(path for path in PACKAGE.rglob("*.py") if BOUNDARY not in path.parents)


def test_only_the_boundary_imports_mergekit() -> None:
    offenders = {
        str(path.relative_to(ROOT)): sorted(m for m in imported_modules(path) if m.split(".")[0] == "mergekit")
        for path in plain_modules()
    }
    assert {path: modules for path, modules in offenders.items() if modules} == {}
    assert "mergekit.merge_methods" in imported_modules(BOUNDARY / "methods.py")  # the scan sees imports


def _without_mergekit(code: str) -> subprocess.CompletedProcess:
    environment = {**os.environ, "MERGEKIT_RAM_AUTOLOAD": "0", "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-c", BLOCK_MERGEKIT + code], cwd=ROOT, env=environment, capture_output=True, text=True
    )


@pytest.mark.process
def test_every_plain_module_imports_without_mergekit() -> None:
    names = [
        ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__") for path in plain_modules()
    ]
    completed = _without_mergekit(
        "import importlib\n"
        f"for name in {names!r}:\n"
        "    importlib.import_module(name)\n"
        "import mergekit_ram.integration\n"  # the package itself imports no mergekit until used
        "print(len(sys.modules) and 'ok')\n"
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert completed.stdout.strip() == "ok"
    blocked = _without_mergekit("import mergekit_ram.integration.merge")
    assert "blocked by tests/test_layers.py" in blocked.stderr  # the blocker works


def test_the_layers_below_the_top_never_reach_the_boundary() -> None:
    """No plain module but the top ones imports the boundary or the package's lazy entry points, even
    inside a function: the math, statistics, files and transaction layers run without mergekit."""
    reaching = {"mergekit_ram", "mergekit_ram.integration"}
    offenders = {
        str(path.relative_to(ROOT)): sorted(
            m for m in imported_modules(path) if m in reaching or m.startswith("mergekit_ram.integration.")
        )
        for path in plain_modules()
        if str(path.relative_to(ROOT)) not in TOP
    }
    assert {path: modules for path, modules in offenders.items() if modules} == {}
    assert "mergekit_ram.integration.merge" in imported_modules(ROOT / TOP[-1])  # the scan sees deferred imports


#: Importing a boundary module before mergekit makes mergekit's import happen half-way through it; the
#: start-up hook must still register the methods (it waits for the boundary) and put the seams in place.
IMPORT_FIRST = (
    "mergekit_ram.integration.seam",  # it imports the whole boundary: mergekit arrives half-way through it
    "mergekit.scripts.run_yaml",  # mergekit first, as its scripts do
)

CHECK_PATCHES = """
import mergekit.merge, mergekit.plan, mergekit.scripts.run_yaml, mergekit.scripts.multimerge
import mergekit.scripts.merge_raw_pytorch, mergekit.merge_methods
from mergekit_ram.integration.registration import ours
seams = [mergekit.merge.run_merge, mergekit.scripts.merge_raw_pytorch.plan_flat_merge]
print(
    all(ours(name) is not None for name in ("ram", "ram_plus", "ram_ties", "ram_unique")),
    all(getattr(function, "__mergekit_ram_seam__", False) for function in seams),
    mergekit.scripts.run_yaml.run_merge is mergekit.merge.run_merge,
    mergekit.scripts.multimerge.run_merge is mergekit.merge.run_merge,
)
"""


@pytest.mark.process
def test_any_import_order_registers_and_puts_the_seams_in_place() -> None:
    environment = {**os.environ, "PYTHONPATH": str(ROOT)}
    environment.pop("MERGEKIT_RAM_AUTOLOAD", None)
    runs = {
        first: subprocess.Popen(
            [sys.executable, "-W", "error::UserWarning", "-c", f"import {first}\n" + CHECK_PATCHES],
            cwd=ROOT,
            env=environment,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for first in IMPORT_FIRST
    }
    results = {first: run.communicate() for first, run in runs.items()}
    assert {first: out.strip() for first, (out, _) in results.items()} == {
        first: "True True True True" for first in IMPORT_FIRST
    }, {first: err[-2000:] for first, (_, err) in results.items()}
