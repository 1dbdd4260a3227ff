"""The boundary: every use of mergekit's internals, and nothing else, lives in this subpackage.

- ``versions``: the version guard (``require``, ``wrap``, ``MergekitMovedError``);
- ``registry``: ``ram_plus`` registered, the built-in ``ram`` replaced (``MERGEKIT_RAM_BUILTIN_RAM``);
- ``methods``: the ``ram`` and ``ram_plus`` methods on mergekit's method API;
- ``tasks``: graph tasks (pre-pass count, merge-and-count, statistics file) and merge tasks as plain data;
- ``planner``: ``MergePlanner`` and ``plan_flat_merge`` wrapped: checks, pre-pass, lambdas, statistics;
- ``output``: ``run_merge`` and the ``mergekit-pytorch`` command inside the output transaction;
- ``scripts``: the console scripts (one-line errors, CUDA check, mergekit-multi's stages);
- ``recipes``: recipe checks over mergekit's recipe classes, mergekit-multi's stages;
- ``inmemory``: mergekit's ``merge_state_dicts`` for RAM, with the statistics; pins for some models in mergekit's own.

A new mergekit release means editing this subpackage only. Each patch is idempotent and
checks that the internals it relies on are still there, failing with the mergekit version in
the message if they moved. ``mergekit_ram._autoload`` calls the patch functions below as
each mergekit module finishes importing; ``register()`` calls them all. Importing this package
imports no mergekit: each submodule does, when it is used.
"""

from __future__ import annotations

__all__ = ["register"]


def register() -> None:
    """Register ``ram`` and ``ram_plus`` with mergekit and hook its planner; idempotent."""
    import mergekit.merge
    import mergekit.merge_methods
    import mergekit.plan
    import mergekit.scripts.merge_raw_pytorch
    import mergekit.scripts.multimerge
    import mergekit.scripts.run_yaml

    from mergekit_ram.integration.inmemory import patch_merge_state_dicts
    from mergekit_ram.integration.output import patch_raw_pytorch, patch_run_merge
    from mergekit_ram.integration.planner import patch_planner
    from mergekit_ram.integration.registry import register_methods
    from mergekit_ram.integration.scripts import patch_multimerge, patch_script

    register_methods(mergekit.merge_methods)
    patch_merge_state_dicts(mergekit.merge_methods)
    patch_planner(mergekit.plan)
    patch_run_merge(mergekit.merge)
    patch_raw_pytorch(mergekit.scripts.merge_raw_pytorch)
    patch_multimerge(mergekit.scripts.multimerge)
    for script in (mergekit.scripts.run_yaml, mergekit.scripts.multimerge, mergekit.scripts.merge_raw_pytorch):
        patch_script(script)
