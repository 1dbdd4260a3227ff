"""Registers mergekit-ram with mergekit the moment mergekit is imported.

Imported at interpreter start by ``mergekit_ram_autoload.pth``; standard library only,
so it costs well under a millisecond. A ``sys.meta_path`` finder watches six mergekit
modules; when one finishes executing, the matching functions of
``mergekit_ram.integration`` patch it. Every other import passes straight through.
Set ``MERGEKIT_RAM_AUTOLOAD=0`` to switch it off; ``mergekit_ram.register()`` then does
the same explicitly.
"""

import os
import sys

ENVIRONMENT_VARIABLE = "MERGEKIT_RAM_AUTOLOAD"

# mergekit module -> "module:function" of mergekit_ram.integration that patch it once it has
# executed, in order. Each names its own submodule, so a hook that fires while another part of
# the boundary is still importing needs only its own module.
HOOKS = {
    "mergekit.merge_methods": ("registry:register_methods",),
    "mergekit.plan": ("planner:patch_planner",),
    "mergekit.merge": ("output:patch_run_merge",),
    "mergekit.scripts.run_yaml": ("scripts:patch_script",),
    "mergekit.scripts.multimerge": ("scripts:patch_multimerge", "scripts:patch_script"),
    "mergekit.scripts.merge_raw_pytorch": ("output:patch_raw_pytorch", "scripts:patch_script"),
}


def enabled():
    return os.environ.get(ENVIRONMENT_VARIABLE, "1").strip().lower() not in ("0", "false", "no", "off")


class MergekitFinder:
    """Finds nothing itself; wraps the real loader's exec_module for the hooked modules."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in HOOKS:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is not None and hasattr(loader, "exec_module"):
            loader.exec_module = _after(loader.exec_module, HOOKS[fullname])
        return spec


def _after(exec_module, hook_names):
    def exec_and_patch(module):
        exec_module(module)
        for hook_name in hook_names:
            try:
                import importlib

                submodule, _, function = hook_name.partition(":")
                getattr(importlib.import_module(f"mergekit_ram.integration.{submodule}"), function)(module)
            except Exception as error:  # never break mergekit's own import
                import warnings

                warnings.warn(
                    f"mergekit-ram could not hook {module.__name__}: {error!r}. "
                    f"Call mergekit_ram.register() explicitly, or set {ENVIRONMENT_VARIABLE}=0.",
                    stacklevel=2,
                )

    return exec_and_patch


def install():
    """Put the finder first on sys.meta_path, once."""
    if not any(isinstance(finder, MergekitFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, MergekitFinder())


if enabled():
    install()
