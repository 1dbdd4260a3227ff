"""The boundary: every use of mergekit's internals lives in this subpackage (``internals`` holds the table;
docs/contributing.md lists the modules). Each patch is idempotent; ``mergekit_ram._autoload`` calls them as
mergekit's modules finish importing, ``register()`` calls them all. Importing this package imports no mergekit.
"""

from __future__ import annotations

import importlib

__all__ = ["register"]


def register() -> None:
    """Register the methods with mergekit and hook its run_merge and scripts; idempotent."""
    from mergekit_ram.integration.internals import check_internals
    from mergekit_ram.integration.output import patch_run_merge
    from mergekit_ram.integration.registry import register_methods
    from mergekit_ram.integration.scripts import patch_scripts

    check_internals()
    module = importlib.import_module
    register_methods(module("mergekit.merge_methods"))
    patch_run_merge(module("mergekit.merge"))
    patch_scripts(module("mergekit.options"))
