"""The boundary: every use of mergekit's internals, and nothing else, lives in this subpackage.

- ``internals``: the one table of mergekit objects the plugin uses, each reached through the
  version guard (``internal``, ``wrap``, ``check_internals``, ``MergekitMovedError``);
- ``registry``: the methods registered, the built-in ``ram`` replaced (``MERGEKIT_RAM_BUILTIN_RAM``);
- ``methods``: the four methods on mergekit's method API;
- ``merge``: one merge as a sequence: plan (mergekit's planner, unpatched), counts, statistics,
  the lambdas written into the recipe;
- ``output``: ``run_merge`` and the ``mergekit-pytorch`` command inside the output transaction;
- ``scripts``: the console scripts (one-line errors, CUDA check, mergekit-multi's stages);
- ``recipes``: recipe checks over mergekit's recipe classes, mergekit-multi's stages;
- ``inmemory``: mergekit's ``merge_state_dicts`` for these methods, with the statistics.

A new mergekit release means editing this subpackage only (``internals`` first). Each patch is
idempotent. ``mergekit_ram._autoload`` calls the patch functions below as each mergekit module
finishes importing; ``register()`` calls them all. Importing this package imports no mergekit:
each submodule does, when it is used.
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
