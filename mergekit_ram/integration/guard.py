"""Where an ``INTERNALS`` entry has moved, the plugin stays out and says so: one warning line, the methods
unregistered, and mergekit's scripts and ``run_merge`` refusing recipes naming them (``ram`` included) in one
line with the pip command; other recipes run as mergekit alone. Plain ``getattr`` here: the table has moved.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from types import ModuleType
from typing import Any, Callable, Optional

from mergekit_ram.errors import exit_on_one_line, one_line
from mergekit_ram.integration.internals import (
    SUPPORTED_MERGEKIT,
    TESTED_MERGEKIT,
    MergekitMovedError,
    install_command,
    mergekit_found,
)
from mergekit_ram.interrupts import merge_started
from mergekit_ram.parameters import METHOD_PARAMETERS

LOG = logging.getLogger(__name__)
#: The mergekit modules whose entry points refuse the plugin's methods: console scripts, run_merge.
REFUSING = (
    "mergekit.merge",
    "mergekit.scripts.run_yaml",
    "mergekit.scripts.multimerge",
    "mergekit.scripts.merge_raw_pytorch",
)
_MARK = "__mergekit_ram_refusal__"


def step_aside(error: BaseException, module: str) -> str:
    """The plugin out of mergekit after ``error`` (hooking ``module``); the reason, for modules imported later."""
    if isinstance(error, MergekitMovedError):
        reason = one_line(error)
    else:  # not a moved internal: a patch that failed all the same
        reason = (
            f"mergekit-ram could not patch {module} of {mergekit_found()} ({type(error).__name__}: {one_line(error)}); "
            f"it supports mergekit{SUPPORTED_MERGEKIT} (tested: {', '.join(TESTED_MERGEKIT)}): {install_command()}"
        )
    LOG.warning(
        "%s; until then mergekit-ram is not active: recipes naming %s are refused and other methods run as "
        "mergekit alone (pip uninstall mergekit-ram to use this mergekit without it)",
        reason,
        ", ".join(METHOD_PARAMETERS),
    )
    registry = sys.modules.get("mergekit_ram.integration.registry")
    if registry is not None and "mergekit.merge_methods" in sys.modules:
        with contextlib.suppress(MergekitMovedError):  # no registry table: nothing was registered in it
            registry.unregister_methods()
    for name in REFUSING:
        imported = sys.modules.get(name)
        if imported is not None:
            refuse(imported, reason)
    return reason


def refuse(module: ModuleType, reason: str) -> None:
    """``module``'s entry point (in ``REFUSING``; others are left) refuses the plugin's methods; idempotent."""
    if module.__name__ == "mergekit.merge":
        _wrap(module, "run_merge", lambda original: _refusing_run_merge(original, reason))
    elif module.__name__ in REFUSING:
        command = getattr(module, "main", None)
        if command is not None:
            _wrap(command, "callback", lambda original: _refusing_script(command, original, reason))


def not_active(method: str, reason: str) -> MergekitMovedError:
    return MergekitMovedError(f"merge_method {method} is mergekit-ram's, which is not active here: {reason}")


def refused_method(methods: list[str]) -> Optional[str]:
    """The first of ``methods`` only mergekit-ram runs (``ram`` too, unless the built-in one is asked for)."""
    from mergekit_ram.integration.registry import keep_builtin_ram

    return next((m for m in methods if m in METHOD_PARAMETERS and not (m == "ram" and keep_builtin_ram())), None)


def _wrap(owner: Any, attribute: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    original = getattr(owner, attribute, None)
    if not callable(original) or getattr(original, _MARK, False):
        return
    wrapper = make(original)
    setattr(wrapper, _MARK, True)
    setattr(owner, attribute, wrapper)


def _refusing_run_merge(original: Callable[..., Any], reason: str) -> Callable[..., Any]:
    def run_merge(*args: Any, **kwargs: Any) -> Any:
        config = args[0] if args else kwargs.get("merge_config")
        method = refused_method([str(getattr(config, "merge_method", ""))])
        if method is not None:
            raise not_active(method, reason)
        return original(*args, **kwargs)

    return run_merge


def _refusing_script(command: Any, original: Callable[..., Any], reason: str) -> Callable[..., Any]:
    import click

    from mergekit_ram.recipe_file import declared_methods, read_text

    recipe = next((parameter.name for parameter in command.params if isinstance(parameter, click.Argument)), None)

    def callback(*args: Any, **kwargs: Any) -> Any:
        merge_started()  # mergekit's own Ctrl-C from here
        path = kwargs.get(recipe) if recipe else None
        text = read_text(path) if isinstance(path, str) else None
        method = refused_method(declared_methods(text)) if text is not None else None
        if method is not None:
            exit_on_one_line(not_active(method, reason), verbose=False)
        return original(*args, **kwargs)

    return callback
