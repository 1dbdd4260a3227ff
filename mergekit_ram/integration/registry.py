"""mergekit's method registry: the plugin's methods added, the built-in ``ram`` replaced (or kept on
request), and taken back where the plugin steps aside. The methods are imported inside the functions:
``guard`` reads ``keep_builtin_ram`` where their module cannot be imported (a moved mergekit)."""

from __future__ import annotations

import logging
import os
from types import ModuleType

from mergekit_ram.integration.internals import (
    TESTED_MERGEKIT,
    install_command,
    internal,
    mergekit_found,
    mergekit_version,
)

LOG = logging.getLogger(__name__)

#: Set to 1 to keep mergekit's own ``ram`` (``ram_plus`` stays mergekit-ram's); read at registration.
BUILTIN_RAM_VARIABLE = "MERGEKIT_RAM_BUILTIN_RAM"


def keep_builtin_ram() -> bool:
    return os.environ.get(BUILTIN_RAM_VARIABLE, "").strip().lower() in ("1", "true", "yes", "on")


def register_methods(merge_methods: ModuleType) -> None:
    """Add the methods to the registry, replacing only the built-in ``ram`` (kept with the variable set)."""
    from mergekit_ram.integration.methods import METHODS

    table = internal("mergekit.merge_methods.registry", "_METHODS")
    untested = mergekit_version() not in TESTED_MERGEKIT
    if untested and any(table.get(name) is not method for name, method in METHODS.items()):
        LOG.warning(
            "mergekit-ram is tested with mergekit %s, not with %s, whose internals it uses are where it expects "
            "them: if a merge looks wrong, %s",
            ", ".join(TESTED_MERGEKIT),
            mergekit_found(),
            install_command(),
        )
    builtin = internal("mergekit.merge_methods", "ram_merge")  # the built-in ``ram`` method object
    for name, method in METHODS.items():
        current = table.get(name)
        if name == "ram" and keep_builtin_ram() and current in (method, builtin):
            table[name] = builtin
            LOG.warning(
                "mergekit-ram: %s=1: keeping mergekit's built-in 'ram' (arithmetic in the checkpoint dtype, "
                "no ram_statistics.json); 'ram_plus' is mergekit-ram's",
                BUILTIN_RAM_VARIABLE,
            )
        elif current is method:
            continue
        elif current is None:
            table[name] = method
        elif name == "ram" and current is builtin:
            table[name] = method
            LOG.info("mergekit-ram: replaced mergekit's built-in 'ram' (checkpoint-dtype arithmetic) with float32 RAM")
        else:
            LOG.warning("mergekit-ram: merge method %r is already registered by someone else; leaving it", name)


def unregister_methods() -> None:
    """``register_methods`` undone, the built-in ``ram`` put back: a moved mergekit runs as itself alone."""
    from mergekit_ram.integration.methods import METHODS

    table = internal("mergekit.merge_methods.registry", "_METHODS")
    for name, method in METHODS.items():
        if table.get(name) is method:
            if name == "ram":
                table[name] = internal("mergekit.merge_methods", "ram_merge")
            else:
                del table[name]


def is_ours(method_name: str) -> bool:
    """Whether mergekit would run mergekit-ram's method for ``method_name`` now."""
    from mergekit_ram.integration.methods import METHODS

    return (
        method_name in METHODS
        and internal("mergekit.merge_methods.registry", "_METHODS").get(method_name) is METHODS[method_name]
    )


def declared_by_other_methods(method: str) -> dict[str, list[str]]:
    """Parameter name -> the other registered methods that declare it."""
    from mergekit_ram.integration.methods import HIDDEN_PARAMETERS

    declared: dict[str, list[str]] = {}
    for other in list(internal("mergekit.merge_methods.registry", "_METHODS").values()):
        spec = getattr(other, "spec", None)
        if spec is None or spec.name == method:
            continue
        for parameter in spec.parameters:
            if parameter.name not in HIDDEN_PARAMETERS:  # mergekit-ram's merge step sets those, never a recipe
                declared.setdefault(parameter.name, []).append(spec.name)
    return declared
