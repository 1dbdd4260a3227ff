"""Registers mergekit-ram with mergekit the moment mergekit is imported.

Imported at interpreter start by ``mergekit_ram_autoload.pth``; standard library only, so it
costs about 1.5 ms, the package's ``__init__`` included. A ``sys.meta_path`` finder watches six
mergekit modules; when one finishes executing, the matching functions of
``mergekit_ram.integration`` patch it (deferred while a module of that boundary is itself
half-imported). Every other import passes straight through.
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


BOUNDARY = "mergekit_ram.integration"


class MergekitFinder:
    """Finds nothing itself; wraps the real loader's exec_module of the hooked mergekit modules,
    and of the boundary's own modules.

    A hook runs once its mergekit module has executed and no boundary module is half-imported:
    importing, say, ``mergekit_ram.integration.methods`` first imports mergekit from inside it,
    and its hook (which needs that module's methods) then waits until the module is complete.
    """

    def __init__(self):
        self.boundary_importing = 0  # boundary modules executing right now
        self.pending = []  # (hook name, mergekit module), in the order mergekit imported them
        self.applying = False  # apply_pending is running: hooks keep their order

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in HOOKS and not fullname.startswith(BOUNDARY + "."):
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
            loader.exec_module = self._wrapped(loader.exec_module, fullname)
        return spec

    def _wrapped(self, exec_module, fullname):
        def exec_and_patch(module):
            if fullname in HOOKS:
                exec_module(module)
                self.pending.extend((hook_name, module) for hook_name in HOOKS[fullname])
            else:
                self.boundary_importing += 1
                try:
                    exec_module(module)
                finally:
                    self.boundary_importing -= 1
            if not self.boundary_importing:
                self.apply_pending()

        return exec_and_patch

    def apply_pending(self):
        """Run the hooks that are due, in order; a failing hook warns and never breaks mergekit's import.

        Importing a hook's boundary module can finish importing other modules: the loop that is
        already running takes their hooks after the current one, so patches keep their order
        (``mergekit-pytorch``'s transaction inside its one-line errors).
        """
        if self.applying:
            return
        self.applying = True
        try:
            self._apply_in_order()
        finally:
            self.applying = False

    def _apply_in_order(self):
        while self.pending:
            hook_name, module = self.pending.pop(0)
            try:
                import importlib

                submodule, _, function = hook_name.partition(":")
                getattr(importlib.import_module(f"{BOUNDARY}.{submodule}"), function)(module)
            except Exception as error:  # never break mergekit's own import
                import warnings

                warnings.warn(
                    f"mergekit-ram could not hook {module.__name__}: {error!r}. "
                    f"Call mergekit_ram.register() explicitly, or set {ENVIRONMENT_VARIABLE}=0.",
                    stacklevel=2,
                )


def install():
    """Put the finder first on sys.meta_path, once."""
    if not any(isinstance(finder, MergekitFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, MergekitFinder())


if enabled():
    install()
