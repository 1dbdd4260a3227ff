"""Every mergekit internal this plugin uses, in one table: boundary modules reach them with ``internal`` and
patch them with ``wrap``. One moved, renamed or re-signed fails with a ``MergekitMovedError`` naming the
version, before any merge starts.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import importlib.util
import inspect
import sys
from typing import Any, Callable, NamedTuple, Optional

from mergekit_ram.errors import RamError

#: The mergekit releases the test suite ran on, oldest first (CI: the oldest, and the newest pip installs).
TESTED_MERGEKIT = ("0.1.5",)
#: pyproject.toml's range for mergekit: the releases whose internals are expected where this table has them.
SUPPORTED_MERGEKIT = ">=0.1.5,<0.2"
_MARK = "__mergekit_ram_wrapped__"


class MergekitMovedError(RamError, RuntimeError):
    """A mergekit internal this plugin relies on is not where the tested mergekit releases have it."""


class Internal(NamedTuple):
    """``name`` (dotted for a class's attribute) in ``module``; a patched callable's expected ``parameters``."""

    module: str
    name: str
    parameters: Optional[tuple[str, ...]] = None


#: What the plugin uses, and why (the boundary module in brackets).
INTERNALS = (
    # Registration (registry): the method registry's table, to add the methods and replace only the built-in `ram`.
    Internal("mergekit.merge_methods.registry", "_METHODS"),
    Internal("mergekit.merge_methods", "ram_merge"),
    # The method API (methods): a group method, its spec and parameters; mergekit's in-memory API (inmemory).
    Internal("mergekit.merge_methods.base", "GroupMergeMethod"),
    Internal("mergekit.merge_methods.base", "MergeMethodSpec"),
    Internal("mergekit.merge_methods.base", "InputContract"),
    Internal("mergekit.merge_methods.base", "ParameterSpec"),
    Internal("mergekit.merge_methods", "merge_state_dicts"),
    # Planning as run_merge plans, and the pre-pass over the planned inputs (merge).
    Internal("mergekit.plan", "MergePlanner"),
    Internal("mergekit.architecture", "get_architecture_info"),
    Internal("mergekit.merge", "_model_out_config", ("config", "arch_info", "trust_remote_code")),
    Internal("mergekit.io.tasks", "LoaderCache"),
    Internal("mergekit.graph", "Executor"),
    # Recipes and options (recipes, scripts, output).
    Internal("mergekit.config", "MergeConfiguration"),
    Internal("mergekit.options", "MergeOptions"),
    Internal("mergekit.architecture.json_definitions", "NAME_TO_ARCH"),
    Internal("mergekit.scripts.multimerge", "patched_config"),
    # mergekit-pytorch: its recipe class and its flat plan (output).
    Internal("mergekit.scripts.merge_raw_pytorch", "RawPyTorchMergeConfig"),
    Internal(
        "mergekit.scripts.merge_raw_pytorch",
        "plan_flat_merge",
        ("config", "out_path", "tensor_union", "tensor_intersection", "options"),
    ),  # fmt: skip
    # The two wraps: run_merge (the merge step, the output transaction), the console scripts' shared click
    # command class (one-line errors; mergekit-pytorch's merge step and output transaction).
    Internal("mergekit.merge", "run_merge", ("merge_config", "out_path", "options", "config_source")),
    Internal("mergekit.options", "PrettyPrintHelp.invoke", ("self", "ctx")),
)
_ENTRIES = {(entry.module, entry.name): entry for entry in INTERNALS}


def mergekit_version() -> str:
    """The installed distribution's version (mergekit has no ``__version__``)."""
    try:
        return importlib.metadata.version("mergekit")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def mergekit_found() -> str:
    """'mergekit <version> (<folder>)': the mergekit this process imports."""
    try:
        spec = importlib.util.find_spec("mergekit")
    except (ImportError, ValueError):
        spec = None
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    return f"mergekit {mergekit_version()}" + (f" ({folders[0]})" if folders else "")


def install_command() -> str:
    """pip installing the newest tested mergekit, over a build calling itself that version too."""
    tested = TESTED_MERGEKIT[-1]
    force = " --force-reinstall --no-deps" if mergekit_version() == tested else ""
    return f'pip install{force} "mergekit=={tested}"'


def _moved(what: str, detail: str = "") -> MergekitMovedError:
    return MergekitMovedError(
        f"mergekit-ram cannot find {what}{detail} in {mergekit_found()}; it supports mergekit{SUPPORTED_MERGEKIT} "
        f"where that is unchanged (tested: {', '.join(TESTED_MERGEKIT)}): {install_command()}"
    )


def internal(module: str, name: str) -> Any:
    """The ``INTERNALS`` entry ``module.name``, checked to exist (and take the parameters expected)."""
    entry = _ENTRIES[(module, name)]
    importlib.import_module("mergekit")  # mergekit itself missing: its own ImportError, not "moved"
    try:
        value: Any = importlib.import_module(module)
    except ImportError:
        raise _moved(module) from None
    for part in name.split("."):
        if not hasattr(value, part):
            raise _moved(f"{module}.{name}")
        value = getattr(value, part)
    if entry.parameters is not None:
        found = tuple(inspect.signature(inspect.unwrap(value)).parameters)
        if found != entry.parameters:
            raise _moved(f"{module}.{name}", f" with the parameters {', '.join(entry.parameters)}")
    return value


def check_internals(imported_only: bool = False) -> None:
    """Every entry resolved (``imported_only``: of modules imported already, cheap for the start-up hook)."""
    for entry in INTERNALS:
        if not imported_only or entry.module in sys.modules:
            internal(entry.module, entry.name)


def wrap(module: str, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    """Replace the entry ``module.name`` (maybe ``Class.method``) by ``make(original)``, once."""
    original = internal(module, name)  # checks the whole path
    if getattr(original, _MARK, False):
        return
    *owners, attribute = name.split(".")
    owner = functools.reduce(getattr, owners, importlib.import_module(module))
    wrapper = functools.wraps(original)(make(original))
    setattr(wrapper, _MARK, True)
    setattr(owner, attribute, wrapper)
