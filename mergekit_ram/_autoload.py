"""Registers mergekit-ram with mergekit the moment mergekit is imported (imported at interpreter start by
``mergekit_ram_autoload.pth``; standard library only). A ``sys.meta_path`` finder runs ``HOOKS`` once no
mergekit or boundary module is half-executed; where an internal has moved, the plugin steps aside
(``integration.guard``). ``MERGEKIT_RAM_AUTOLOAD=0`` switches it off. In a command that runs a merge, a
Ctrl-C before its callback begins is one line and exit status 130 (``mergekit_ram.interrupts``).
"""

import os
import sys

ENVIRONMENT_VARIABLE = "MERGEKIT_RAM_AUTOLOAD"

# mergekit module -> the "module:function" of mergekit_ram.integration that patches it; each names its own
# submodule, so a hook fired while the boundary is still importing needs only that one.
HOOKS = {
    "mergekit.merge_methods": "registry:register_methods",
    "mergekit.merge": "output:patch_run_merge",
    "mergekit.options": "scripts:patch_scripts",
}
BOUNDARY = "mergekit_ram.integration"


def enabled():
    return os.environ.get(ENVIRONMENT_VARIABLE, "1").strip().lower() not in ("0", "false", "no", "off")


class MergekitFinder:
    """Wraps the real loader's exec_module of mergekit's and the boundary's modules. Hooks wait until none is
    half-executed: ``mergekit.merge`` imports ``mergekit.merge_methods`` before its own objects exist."""

    def __init__(self):
        self.executing = 0  # mergekit and boundary modules executing right now
        self.pending = []  # (hook name, mergekit module), in the order mergekit imported them
        self.applying = False  # apply_pending is running: hooks keep their order
        self.refusal = None  # why the plugin stepped aside (then hooks only make mergekit refuse its methods)

    def find_spec(self, fullname, path=None, target=None):
        if fullname.partition(".")[0] != "mergekit" and not fullname.startswith(BOUNDARY + "."):
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
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        exec_module = loader.exec_module

        def exec_and_patch(module):
            self.executing += 1
            try:
                exec_module(module)
            finally:
                self.executing -= 1
            if fullname in HOOKS:
                self.pending.append((HOOKS[fullname], module))
            if not self.executing:
                self.apply_pending()

        loader.exec_module = exec_and_patch
        return spec

    def apply_pending(self):
        """Run the due hooks in order; a failing hook never breaks mergekit's import. A hook's import can
        finish other modules: the loop already running takes their hooks after the current one."""
        if self.applying:
            return
        self.applying = True
        try:
            while self.pending:
                hook_name, module = self.pending.pop(0)
                try:
                    if self.refusal is not None:
                        self._call("guard:refuse", module, self.refusal)
                        continue
                    self._call("internals:check_internals", imported_only=True)
                    self._call(hook_name, module)
                except Exception as error:  # never break mergekit's own import
                    if self.refusal is not None:
                        self._warn(f"mergekit-ram could not make {module.__name__} refuse its methods: {error!r}")
                        continue
                    self.refusal = f"mergekit-ram could not hook {module.__name__}: {error!r}"
                    try:
                        self.refusal = self._call("guard:step_aside", error, module.__name__)
                    except Exception as failure:
                        self._warn(f"{self.refusal}; stepping aside failed too: {failure!r}")
        finally:
            self.applying = False

    @staticmethod
    def _call(hook_name, *args, **kwargs):
        import importlib  # when a hook runs: a clean environment starts without importlib

        submodule, _, function = hook_name.partition(":")
        return getattr(importlib.import_module(f"{BOUNDARY}.{submodule}"), function)(*args, **kwargs)

    @staticmethod
    def _warn(message):
        """The last resort, where the boundary's own modules fail: one warning line."""
        import logging

        LOG = logging.getLogger("mergekit_ram")
        LOG.warning("%s; set %s=0 to run mergekit without mergekit-ram", message, ENVIRONMENT_VARIABLE)
        from mergekit_ram.interrupts import merge_started

        merge_started()  # mergekit's callbacks may stay unhooked: its own Ctrl-C from here


def runs_a_merge(argv, hooked):
    """Whether ``argv`` runs a merge through a callback this plugin hooks: mergekit's hooked scripts, and
    mergekit-ram's runners (the callback ends the quiet start)."""
    command = os.path.basename(argv[0]) if argv else ""
    if command == "mergekit-ram":
        return len(argv) > 1 and argv[1] in ("yaml", "multi", "pytorch")
    return hooked and command in ("mergekit-yaml", "mergekit-multi", "mergekit-pytorch")


if enabled() and not any(isinstance(finder, MergekitFinder) for finder in sys.meta_path):
    sys.meta_path.insert(0, MergekitFinder())
if runs_a_merge(getattr(sys, "argv", []), enabled()):
    from mergekit_ram import interrupts

    interrupts.quiet_start()
