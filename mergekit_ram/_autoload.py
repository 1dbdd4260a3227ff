"""The start-up hook (imported at interpreter start by ``mergekit_ram_autoload.pth``; standard library only).

A ``sys.meta_path`` finder watches the ``mergekit`` package and three of its modules and acts once each has
finished executing: ``mergekit`` gets its version checked (its metadata: nothing else of mergekit's imported);
``mergekit.merge`` gets the seam around ``run_merge`` and ``mergekit.scripts.merge_raw_pytorch`` around
``plan_flat_merge`` at once (thin wrappers here, so that a module importing ``run_merge`` by name later gets
the seam; the plugin itself loads only when one is called); ``mergekit.merge_methods`` registers the four
methods as soon as no module of the boundary is half-executed (the registration imports them; importing one
of them may be what imported mergekit). A mergekit the plugin cannot run with (``internals.unsupported``: its
version, then the public names the plugin imports) gets one line, once, and nothing registered; the seams then
only refuse the plugin's methods. A hook that fails never breaks mergekit's import: one warning line.
``MERGEKIT_RAM_AUTOLOAD=0`` switches it off (then ``mergekit_ram.register()``). In mergekit's merging scripts,
Ctrl-C before the merge is one line.
"""

import os
import sys

ENVIRONMENT_VARIABLE = "MERGEKIT_RAM_AUTOLOAD"
#: The package whose version is checked as soon as it is imported.
PACKAGE = "mergekit"
#: Set on the mergekit package once the line saying the plugin is off has been logged (once a process).
SAID = "__mergekit_ram_off__"
#: mergekit module -> the attribute the seam wraps (None: the methods are registered).
HOOKS = {
    "mergekit.merge_methods": None,
    "mergekit.merge": "run_merge",
    "mergekit.scripts.merge_raw_pytorch": "plan_flat_merge",
}
MERGE_SCRIPTS = ("mergekit-yaml", "mergekit-multi", "mergekit-pytorch")
BOUNDARY = "mergekit_ram.integration."


def enabled():
    return os.environ.get(ENVIRONMENT_VARIABLE, "1").strip().lower() not in ("0", "false", "no", "off")


def seam(name, original):
    """``original`` (mergekit's ``run_merge`` or ``plan_flat_merge``) behind the seam of the same name."""
    if getattr(original, "__mergekit_ram_seam__", False):
        return original

    def entry(*args, **kwargs):
        from mergekit_ram.integration import internals

        refusal = internals.unsupported()
        if refusal is None:
            from mergekit_ram.integration import seam as seams

            return getattr(seams, name)(original, *args, **kwargs)
        config = args[0] if args else kwargs.get("merge_config", kwargs.get("config"))
        internals.refuse_method(config.merge_method, refusal)
        from mergekit_ram import interrupts

        interrupts.merge_started()  # mergekit alone: its own Ctrl-C
        return original(*args, **kwargs)

    entry.__mergekit_ram_seam__ = True
    entry.__wrapped__ = original
    entry.__name__, entry.__qualname__, entry.__doc__ = original.__name__, original.__qualname__, original.__doc__
    entry.__module__ = original.__module__
    return entry


def hook(module):
    """What the plugin does once ``module`` (``PACKAGE`` or one of ``HOOKS``) has executed: nothing of mergekit's
    imported before its version is checked; where the plugin cannot run, one line (once) and nothing registered."""
    from mergekit_ram.integration.internals import internal, unsupported, version_refusal

    attribute = HOOKS.get(module.__name__)
    registers = module.__name__ in HOOKS and attribute is None
    # the names only once mergekit.merge_methods has executed (the seams check them again when called)
    refusal = unsupported() if registers else version_refusal()
    if refusal is not None:
        say_off(refusal)
    if attribute is None:
        if refusal is None and registers:
            from mergekit_ram.integration.registration import register_methods

            register_methods()
        return
    # checked to be where and as expected, where the plugin runs; else only there to refuse its methods
    original = internal(module.__name__, attribute) if refusal is None else getattr(module, attribute, None)
    if original is not None:
        setattr(module, attribute, seam(attribute, original))


def say_off(refusal):
    """The one line (once a process) saying that the plugin is off, and why."""
    package = sys.modules[PACKAGE]
    if not getattr(package, SAID, False):
        setattr(package, SAID, True)
        import logging

        logging.getLogger("mergekit_ram").warning("%s; its methods are off", refusal)


class MergekitFinder:
    """Wraps the real loader's ``exec_module`` of ``PACKAGE``, of the modules in ``HOOKS`` and of the boundary's."""

    def __init__(self):
        self.executing = 0  # boundary modules executing right now
        self.pending = []  # hooked modules waiting for them, in the order mergekit imported them

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in HOOKS and fullname != PACKAGE and not fullname.startswith(BOUNDARY):
            return None
        for finder in sys.meta_path:  # another copy of this class (a second import of this module) is skipped too
            if type(finder).__name__ == type(self).__name__ or not hasattr(finder, "find_spec"):
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

        def exec_and_hook(module):
            boundary = fullname.startswith(BOUNDARY)
            self.executing += boundary
            try:
                exec_module(module)
            finally:
                self.executing -= boundary
            if HOOKS.get(fullname) or fullname == PACKAGE:
                self.run(module)
            elif fullname in HOOKS:
                self.pending.append(module)
            while self.pending and not self.executing:
                self.run(self.pending.pop(0))

        loader.exec_module = exec_and_hook
        return spec

    @staticmethod
    def run(module):
        try:
            hook(module)
        except Exception as error:  # never break mergekit's own import
            import logging

            logging.getLogger("mergekit_ram").warning(
                "mergekit-ram could not hook %s (%r); set %s=0 to run mergekit without it",
                module.__name__,
                error,
                ENVIRONMENT_VARIABLE,
            )


if enabled() and not any(type(finder).__name__ == MergekitFinder.__name__ for finder in sys.meta_path):
    sys.meta_path.insert(0, MergekitFinder())


def runs_a_merge(argv):
    """mergekit's merging scripts, and mergekit-ram's runners of them (which register the plugin themselves)."""
    command = os.path.basename(argv[0]) if argv else ""
    return command in MERGE_SCRIPTS or (command == "mergekit-ram" and argv[1:2] in (["yaml"], ["multi"], ["pytorch"]))


if runs_a_merge(getattr(sys, "argv", [])) and (enabled() or os.path.basename(sys.argv[0]) == "mergekit-ram"):
    from mergekit_ram import interrupts

    interrupts.quiet_start()
    interrupts.PlainWarnings.install()
