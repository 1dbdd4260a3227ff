"""The mergekit names the plugin uses beyond mergekit's public method API (``mergekit.merge_methods``'s
``__all__``), in one table, and the mergekit releases it supports. A name that moved fails with one line
naming the version and the pip command, when a RAM merge first needs it.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import re
from typing import Any, NamedTuple, Optional

from mergekit_ram.errors import MergekitMovedError

#: The mergekit releases the test suite ran on, oldest first (CI: the oldest, and the newest pip installs).
TESTED_MERGEKIT = ("0.1.5",)
#: pyproject.toml's range for mergekit: the releases whose internals are expected where this table has them.
SUPPORTED_MERGEKIT = ">=0.1.5,<0.2"
_OLDEST, _BEYOND = (0, 1, 5), (0, 2)


class Internal(NamedTuple):
    """``name`` (dotted for a class's attribute) in ``module``; a replaced callable's expected ``parameters``."""

    module: str
    name: str
    parameters: Optional[tuple[str, ...]] = None


#: What the plugin uses, and why (the boundary module in brackets).
INTERNALS = (
    # The seam (seam): run_merge, and mergekit-pytorch's planning entry with its recipe class.
    Internal("mergekit.merge", "run_merge", ("merge_config", "out_path", "options", "config_source")),
    Internal(
        "mergekit.scripts.merge_raw_pytorch",
        "plan_flat_merge",
        ("config", "out_path", "tensor_union", "tensor_intersection", "options"),
    ),  # fmt: skip
    # Registration (registration): the registry's table, to replace the built-in `ram` and bind one merge.
    Internal("mergekit.merge_methods.registry", "_METHODS"),
    # Planning as run_merge plans, and the pre-pass over the planned inputs (merge).
    Internal("mergekit.plan", "MergePlanner"),
    Internal("mergekit.architecture", "get_architecture_info"),
    Internal("mergekit.merge", "_model_out_config", ("config", "arch_info", "trust_remote_code")),
    Internal("mergekit.io.tasks", "LoaderCache"),
    Internal("mergekit.graph", "Executor"),
    # Recipes (recipes): architectures mergekit knows; the probe's options and mergekit-multi's stages (probe).
    Internal("mergekit.architecture.json_definitions", "NAME_TO_ARCH"),
    Internal("mergekit.config", "MergeConfiguration"),
    Internal("mergekit.options", "MergeOptions"),
    Internal("mergekit.scripts.multimerge", "patched_config"),
    # The card run_merge writes, made again for the --hub-id step (card).
    Internal("mergekit.card", "generate_card", ("config", "config_yaml", "name")),
)
_ENTRIES = {(entry.module, entry.name): entry for entry in INTERNALS}


def mergekit_version() -> str:
    """The installed distribution's version (mergekit has no ``__version__``)."""
    try:
        return importlib.metadata.version("mergekit")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def install_command() -> str:
    """pip installing the newest tested mergekit, over a build calling itself that version too."""
    tested = TESTED_MERGEKIT[-1]
    force = " --force-reinstall --no-deps" if mergekit_version() == tested else ""
    return f'pip install{force} "mergekit=={tested}"'


def _release(version: str) -> tuple[int, ...]:
    """The leading numbers of a version: 0.1.5.dev1 -> (0, 1, 5); () where there are none."""
    found = re.match(r"\d+(?:\.\d+)*", version)
    return tuple(int(part) for part in found[0].split(".")) if found else ()


def version_refusal() -> Optional[str]:
    """Why the four methods refuse to merge with the installed mergekit (one line with the pip command);
    None where its version is in ``SUPPORTED_MERGEKIT``."""
    version = mergekit_version()
    if _OLDEST <= _release(version) < _BEYOND:
        return None
    return f"mergekit-ram supports mergekit{SUPPORTED_MERGEKIT}, not {version}: {install_command()}"


def internal(module: str, name: str) -> Any:
    """The ``INTERNALS`` entry ``module.name``, checked to exist (and take the parameters expected)."""
    entry = _ENTRIES[(module, name)]
    try:
        value: Any = importlib.import_module(module)
    except ImportError as error:
        if error.name == "mergekit":  # mergekit itself missing: its own ImportError
            raise
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


def _moved(what: str, detail: str = "") -> MergekitMovedError:
    return MergekitMovedError(
        f"mergekit-ram cannot find {what}{detail} in mergekit {mergekit_version()}; it supports "
        f"mergekit{SUPPORTED_MERGEKIT} where that is unchanged (tested: {', '.join(TESTED_MERGEKIT)}): "
        f"{install_command()}"
    )
