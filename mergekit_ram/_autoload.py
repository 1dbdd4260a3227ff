"""Registers mergekit-ram with mergekit the moment mergekit is imported.

Imported at interpreter start by ``mergekit_ram_autoload.pth``; standard library only, so it
costs about 1.5 ms, the package's ``__init__`` included. A ``sys.meta_path`` finder watches
mergekit's modules; once mergekit has finished importing (no mergekit module, and no module of
``mergekit_ram.integration``, half-executed), the matching functions of
``mergekit_ram.integration`` patch the three modules of ``HOOKS`` that were imported, in order.
Before each patch the internals of every mergekit module imported so far are checked; where one
has moved, the plugin steps aside as a whole (``mergekit_ram.integration.guard``): one warning
line, nothing of it left in mergekit, and recipes naming its methods refused in one line.
Every other import passes straight through.
Set ``MERGEKIT_RAM_AUTOLOAD=0`` to switch it off; ``mergekit_ram.register()`` then does
the same explicitly. In the commands that run a merge (``MERGE_COMMANDS``), a Ctrl-C before the
command's callback begins is one line and exit status 130 (``mergekit_ram.interrupts``).
"""

import os
import sys

ENVIRONMENT_VARIABLE = "MERGEKIT_RAM_AUTOLOAD"

# mergekit module -> "module:function" of mergekit_ram.integration that patch it once it has
# executed, in order. Each names its own submodule, so a hook that fires while another part of
# the boundary is still importing needs only its own module.
HOOKS = {
    "mergekit.merge_methods": ("registry:register_methods",),
    "mergekit.merge": ("output:patch_run_merge",),
    "mergekit.options": ("scripts:patch_scripts",),
}


#: The commands whose callback ends the quiet start (``interrupts.merge_started``): mergekit's scripts where
#: they are hooked, and mergekit-ram's runners of them (which register the plugin themselves).
MERGE_COMMANDS = ("mergekit-yaml", "mergekit-multi", "mergekit-pytorch")
RUNNERS = ("yaml", "multi", "pytorch")


def enabled():
    return os.environ.get(ENVIRONMENT_VARIABLE, "1").strip().lower() not in ("0", "false", "no", "off")


BOUNDARY = "mergekit_ram.integration"


class MergekitFinder:
    """Finds nothing itself; wraps the real loader's exec_module of mergekit's modules and of the
    boundary's own.

    Hooks run once no such module is half-executed: a hook fired while ``mergekit.merge`` is still
    importing (it imports ``mergekit.merge_methods``) would find that module's objects missing, and
    importing ``mergekit_ram.integration.methods`` first imports mergekit from inside it.
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
        if loader is not None and hasattr(loader, "exec_module"):
            loader.exec_module = self._wrapped(loader.exec_module, fullname)
        return spec

    def _wrapped(self, exec_module, fullname):
        def exec_and_patch(module):
            self.executing += 1
            try:
                exec_module(module)
            finally:
                self.executing -= 1
            self.pending.extend((hook_name, module) for hook_name in HOOKS.get(fullname, ()))
            if not self.executing:
                self.apply_pending()

        return exec_and_patch

    def apply_pending(self):
        """Run the hooks that are due, in order; a failing hook never breaks mergekit's import.

        Importing a hook's boundary module can finish importing other modules: the loop that is
        already running takes their hooks after the current one, so patches keep their order.
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


def install():
    """Put the finder first on sys.meta_path, once."""
    if not any(isinstance(finder, MergekitFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, MergekitFinder())


if enabled():
    install()
if runs_a_merge(getattr(sys, "argv", []), enabled()):
    from mergekit_ram import interrupts

    interrupts.quiet_start()
