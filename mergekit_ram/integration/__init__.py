"""The boundary: everything that touches mergekit lives in this subpackage (docs/contributing.md lists its
modules). Importing this package imports no mergekit.
"""

from __future__ import annotations

import importlib

__all__ = ["register"]


def register() -> None:
    """What the start-up hook does, for a process where it is off (``MERGEKIT_RAM_AUTOLOAD=0``): the methods
    registered, ``run_merge`` and mergekit-pytorch's ``plan_flat_merge`` behind the seam; idempotent. mergekit's
    version is checked first: where the plugin cannot run, one line (once) and nothing registered. A module that
    imported ``run_merge`` by name before this call keeps mergekit's own: call it first."""
    from mergekit_ram._autoload import HOOKS, PACKAGE, hook

    for name in (PACKAGE, *HOOKS):
        hook(importlib.import_module(name))
