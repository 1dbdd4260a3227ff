"""Registers mergekit-ram with mergekit the moment mergekit is imported.

Imported at interpreter start by ``mergekit_ram_autoload.pth``; standard library only (about 1.5 ms).
A ``sys.meta_path`` finder watches mergekit's modules; once no mergekit or boundary module is
half-executed, ``HOOKS`` patch those imported, in order, after checking the internals imported so far;
where one has moved, the plugin steps aside as a whole (``integration.guard``). Every other import
passes straight through. ``MERGEKIT_RAM_AUTOLOAD=0`` switches it off (``mergekit_ram.register()``
does the same explicitly). In ``MERGE_COMMANDS``, a Ctrl-C before the command's callback begins is
one line and exit status 130 (``mergekit_ram.interrupts``).
"""

import os
import sys

ENVIRONMENT_VARIABLE = "MERGEKIT_RAM_AUTOLOAD"

# mergekit module -> the "module:function"s of mergekit_ram.integration that patch it, in order; each
# names its own submodule, so a hook fired while the boundary is still importing needs only that one.
HOOKS = {
    "mergekit.merge_methods": ("registry:register_methods",),
    "mergekit.merge": ("output:patch_run_merge",),
    "mergekit.options": ("scripts:patch_scripts",),
}


#: The commands whose callback ends the quiet start: mergekit's hooked scripts, and mergekit-ram's runners.
MERGE_COMMANDS = ("mergekit-yaml", "mergekit-multi", "mergekit-pytorch")
RUNNERS = ("yaml", "multi", "pytorch")


def enabled():
    return os.environ.get(ENVIRONMENT_VARIABLE, "1").strip().lower() not in ("0", "false", "no", "off")


BOUNDARY = "mergekit_ram.integration"


class MergekitFinder:
    """Finds nothing itself; wraps the real loader's exec_module of mergekit's and the boundary's modules.

    Hooks wait until none of those is half-executed: ``mergekit.merge`` imports ``mergekit.merge_methods``
    before its own objects exist, and the boundary's ``methods`` imports mergekit from inside it.
    """

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
            self.pending.extend((hook_name, module) for hook_name in HOOKS.get(fullname, ()))
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
        import importlib

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
    """Whether ``argv`` is a command that runs a merge through a callback this plugin hooks."""
    command = os.path.basename(argv[0]) if argv else ""
    if command == "mergekit-ram":
        return len(argv) > 1 and argv[1] in RUNNERS
    return hooked and command in MERGE_COMMANDS


if enabled() and not any(isinstance(finder, MergekitFinder) for finder in sys.meta_path):
    sys.meta_path.insert(0, MergekitFinder())
if runs_a_merge(getattr(sys, "argv", []), enabled()):
    from mergekit_ram import interrupts

    interrupts.quiet_start()
