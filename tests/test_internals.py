"""The mergekit boundary's one table (``integration/internals.py``): it matches the installed mergekit, a moved
internal fails naming the mergekit version, a mergekit outside the supported range makes the methods refuse,
and the plugin uses nothing of mergekit outside the table and the public method API."""

from __future__ import annotations

import ast
import importlib.metadata
import inspect
from pathlib import Path

import mergekit.merge
import mergekit.merge_methods
import mergekit.scripts.multimerge
import pytest

from mergekit_ram._autoload import HOOKS
from mergekit_ram.errors import MergekitMovedError, ResourceError
from mergekit_ram.integration import internals, methods
from mergekit_ram.integration.internals import INTERNALS, internal, refuse_method, unsupported, version_refusal

PACKAGE = Path(__file__).resolve().parents[1] / "mergekit_ram"


def test_every_entry_resolves_with_the_parameters_the_plugin_expects() -> None:
    for entry in INTERNALS:
        value = internal(entry.module, entry.name)
        assert value is not None, entry
        if entry.parameters is not None:
            assert tuple(inspect.signature(inspect.unwrap(value)).parameters) == entry.parameters, entry


def test_a_moved_internal_fails_naming_the_version(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(mergekit.scripts.multimerge, "patched_config")
    with pytest.raises(MergekitMovedError) as moved:
        internal("mergekit.scripts.multimerge", "patched_config")
    version = importlib.metadata.version("mergekit")  # mergekit has no __version__
    # where the version found is the one tested (a source build?), pip must replace it all the same
    force = " --force-reinstall --no-deps" if version == "0.1.5" else ""
    assert moved.value.format_message() == (
        f"mergekit-ram cannot find mergekit.scripts.multimerge.patched_config in mergekit {version}; "
        "it supports mergekit>=0.1.5,<0.2 where that is unchanged (tested: 0.1.5): "
        f'pip install{force} "mergekit==0.1.5"'
    )


def test_an_attribute_gone_from_a_class_fails_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """A field of the task graph the plugin reads duck-typed (``tensor_task``), gone in another mergekit: one line
    naming it when the boundary is imported, not an AttributeError in the middle of a merge."""
    entry = internals.Internal("mergekit.io.tasks", "SaveTensor", attributes=("tensor_task", "tensor_job"))
    monkeypatch.setitem(internals._ENTRIES, ("mergekit.io.tasks", "SaveTensor"), entry)  # as a later release
    with pytest.raises(MergekitMovedError, match=r"mergekit\.io\.tasks\.SaveTensor with the attributes tensor_job in "):
        internal("mergekit.io.tasks", "SaveTensor")


def test_a_resigned_internal_fails_naming_the_parameters(monkeypatch: pytest.MonkeyPatch) -> None:
    def _model_out_config(config: object, arch_info: object) -> None:
        """mergekit's helper, as a release that dropped a parameter would have it."""

    monkeypatch.setattr(mergekit.merge, "_model_out_config", _model_out_config)
    with pytest.raises(MergekitMovedError, match=r"mergekit\.merge\._model_out_config with the parameters config, "):
        internal("mergekit.merge", "_model_out_config")


@pytest.mark.parametrize(
    ("version", "refused"), [("0.1.5", False), ("0.1.9.dev2", False), ("0.2.0", True), ("0.1.4", True), ("x", True)]
)
def test_a_mergekit_outside_the_range_makes_the_methods_refuse(
    monkeypatch: pytest.MonkeyPatch, version: str, refused: bool
) -> None:
    """One short line with the pip command, found before any of mergekit's names is looked at; a recipe naming
    one of the four methods is refused with it, any other is not."""
    monkeypatch.setattr(internals, "mergekit_version", lambda: version)
    monkeypatch.setattr(internals, "PUBLIC_API", ("a name no mergekit has",))  # looked at only within the range
    refusal = version_refusal()
    assert (refusal is not None) == refused
    if refusal is None:
        assert "cannot find mergekit.merge_methods.a name no mergekit has in mergekit" in str(unsupported())
        return
    assert unsupported() == refusal
    assert refusal == f'mergekit-ram supports mergekit>=0.1.5,<0.2, not {version}: pip install "mergekit==0.1.5"'
    assert len(refusal) < 100  # one terminal line
    for method in ("ram", "ram_plus", "ram_ties", "ram_unique"):  # this process's `ram` is the plugin's
        with pytest.raises(MergekitMovedError, match=f"^{refusal}$"):
            refuse_method(method, refusal)
    refuse_method("task_arithmetic", refusal)


def _mergekit_names(tree: ast.AST) -> list[tuple[str, str, int]]:
    """(module, names, line) of every import of mergekit, and (module, name, line) of every ``internal(...)``
    call (``("", "", line)`` where its arguments are not string literals)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "mergekit":
            found += [(f"import {node.module}", alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.Import):
            mergekit = [alias for alias in node.names if alias.name.split(".")[0] == "mergekit"]
            found += [("import", alias.name, node.lineno) for alias in mergekit]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "internal":
            literal = [a.value for a in node.args[:2] if isinstance(a, ast.Constant) and isinstance(a.value, str)]
            found.append((*(literal if len(literal) == 2 else ("", "")), node.lineno))
    return found


def test_the_plugin_uses_only_the_public_method_api_and_the_table() -> None:
    """Only the boundary imports mergekit, and only the public names of ``mergekit.merge_methods``, each in
    ``PUBLIC_API``; every ``internal`` call names a table entry, and every entry is used."""
    table = {(entry.module, entry.name) for entry in INTERNALS}
    public = set(mergekit.merge_methods.__all__)
    outside, private, unlisted, used, imported = [], [], [], set(), set()
    for path in sorted(PACKAGE.rglob("*.py")):
        place = path.relative_to(PACKAGE).as_posix()
        for module, name, line in _mergekit_names(ast.parse(path.read_text(encoding="utf-8"))):
            if module.startswith("import"):
                if not place.startswith("integration/"):
                    outside.append(f"{place}:{line}")
                if module != "import mergekit.merge_methods" or name not in public:
                    private.append(f"{place}:{line} {module} {name}")
                imported.add(name)
            elif place == "_autoload.py":  # the start-up hook reaches the seams' originals: HOOKS
                used.update((module, attribute) for module, attribute in HOOKS.items() if attribute)
            elif place != "integration/internals.py":
                (used.add((module, name)) if (module, name) in table else unlisted.append(f"{place}:{line}"))
    assert outside == [] and private == [] and unlisted == []
    assert table - used == set(), sorted(table - used)
    assert sorted(imported) == sorted(internals.PUBLIC_API)  # each checked before a module importing it is


def test_the_touch_points_stay_few() -> None:
    """At most 25 mergekit names beyond the public method API (every one the plugin reaches, the task graph's
    classes read duck-typed included), and no class of mergekit's subclassed (so no private method of mergekit's
    is overridden): each is a place where a new mergekit release can break the plugin. The places that replace
    something of mergekit's are counted by ../shared/tools/weight."""
    assert len(INTERNALS) <= 25
    subclasses = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef):
                bases = [ast.unparse(base) for base in node.bases]
                subclasses += [
                    f"{path.name}:{node.name}({base})" for base in bases if "Merge" in base or "Task" in base
                ]
    assert subclasses == []


def test_a_merge_binds_the_methods_for_its_length_only(bf16_models, tmp_path) -> None:
    """The seam binds the registry's methods to the merge's session (the counts of a merge without a pre-pass,
    the output dtype) and gives the registered ones back after it, whether it published or failed."""
    from mergekit_ram.integration.registration import ours
    from tests.conftest import load_statistics, merge_in_process

    registered = {name: ours(name) for name in ("ram", "ram_plus", "ram_ties", "ram_unique")}
    assert all(kernels is not None and kernels.session is None for kernels in registered.values())
    out = str(tmp_path / "out")
    merge_in_process(bf16_models.recipe("ram", out_dtype="float32"), out)
    assert load_statistics(out)["source"] == "merge"  # counted by the methods as they merged, through the session
    assert {name: ours(name) for name in registered} == registered
    with pytest.raises(ResourceError, match="out of memory"), pytest.MonkeyPatch.context() as patch:

        def failing(*args: object, **kwargs: object) -> None:
            assert ours("ram") is not registered["ram"] and ours("ram").session is not None  # bound meanwhile
            raise MemoryError

        patch.setattr(methods, "merge_tensors", failing)  # fails inside mergekit's merge
        merge_in_process(bf16_models.recipe("ram"), str(tmp_path / "failed"))
    assert {name: ours(name) for name in registered} == registered
