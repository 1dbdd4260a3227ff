"""The four methods in mergekit's registry: registered once a process (``register`` for the new names, the
built-in ``ram`` replaced unless ``MERGEKIT_RAM_BUILTIN_RAM=1``); a merge's seam binds them to its ``Session`` for
its length (``bound``).

This module imports mergekit's method API at its top: the start-up hook imports it only for a mergekit the plugin
runs with (``internals.unsupported``); with any other, nothing is registered.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any, Iterator, Optional

from mergekit.merge_methods import ram_merge, register, registered_methods

from mergekit_ram.integration.internals import TESTED_MERGEKIT, internal, mergekit_version
from mergekit_ram.integration.methods import Kernels, Session, declared, kernels_of
from mergekit_ram.parameters import METHOD_NAMES

LOG = logging.getLogger(__name__)

#: Set to 1 to keep mergekit's own ``ram`` (``ram_plus`` stays mergekit-ram's); read at registration.
BUILTIN_RAM_VARIABLE = "MERGEKIT_RAM_BUILTIN_RAM"


def keep_builtin_ram() -> bool:
    return os.environ.get(BUILTIN_RAM_VARIABLE, "").strip().lower() in ("1", "true", "yes", "on")


def register_methods() -> None:
    """Register the four methods once (later calls find them and do nothing), with a mergekit in the range."""
    if ours("ram_plus") is not None:
        return
    if mergekit_version() not in TESTED_MERGEKIT:
        LOG.warning("mergekit-ram is tested with mergekit %s, not %s", ", ".join(TESTED_MERGEKIT), mergekit_version())
    methods = declared(Kernels())
    for name, method in methods.items():
        if name not in _registered_names():
            register(method)
        elif name == "ram" and _table().get(name) is ram_merge and not keep_builtin_ram():
            _table()[name] = method
            LOG.info("mergekit-ram: replaced mergekit's built-in 'ram' (checkpoint-dtype arithmetic) with float32 RAM")
        elif ours(name) is None and name != "ram":
            LOG.warning("mergekit-ram: merge method %r is already registered by someone else; leaving it", name)
    if keep_builtin_ram():
        LOG.warning(
            "mergekit-ram: %s=1: keeping mergekit's built-in 'ram' (arithmetic in the checkpoint dtype, "
            "no ram_statistics.json); 'ram_plus' is mergekit-ram's",
            BUILTIN_RAM_VARIABLE,
        )


def _registered_names() -> set[str]:
    return {method.spec.name for method in registered_methods()}


def _table() -> dict[str, Any]:
    table: dict[str, Any] = internal("mergekit.merge_methods.registry", "_METHODS")
    return table


def ours(name: str) -> Optional[Kernels]:
    """The ``Kernels`` of the method mergekit would run for ``name`` now, where it is mergekit-ram's."""
    return kernels_of(_table().get(name))


@contextlib.contextmanager
def bound(session: Session) -> Iterator[None]:
    """For one merge, the registry's methods of mergekit-ram bound to ``session``; the registered ones after."""
    table = _table()
    registered = {name: table[name] for name in METHOD_NAMES if ours(name) is not None}
    table.update({name: method for name, method in declared(Kernels(session)).items() if name in registered})
    try:
        yield
    finally:
        table.update(registered)


def declared_by_other_methods(method: str) -> dict[str, list[str]]:
    """Parameter name -> the other registered methods that declare it."""
    declared_by: dict[str, list[str]] = {}
    for other in registered_methods():
        if other.spec.name != method:
            for parameter in other.spec.parameters:
                declared_by.setdefault(parameter.name, []).append(other.spec.name)
    return declared_by
