"""The version guard: every reach into mergekit's internals goes through ``require``."""

from __future__ import annotations

import functools
import importlib.metadata
from typing import Any, Callable

from mergekit_ram.errors import RamError

TESTED_MERGEKIT = ("0.1.5",)
_MARK = "__mergekit_ram_wrapped__"


class MergekitMovedError(RamError, RuntimeError):
    """A mergekit internal this plugin relies on is not where mergekit 0.1.5 had it."""


def mergekit_version() -> str:
    try:
        return importlib.metadata.version("mergekit")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def require(owner: Any, name: str) -> Any:
    """``owner.name``, or an error naming the mergekit version if it moved."""
    if not hasattr(owner, name):
        where = getattr(owner, "__name__", type(owner).__name__)
        raise MergekitMovedError(
            f"mergekit-ram cannot find {where}.{name} in mergekit {mergekit_version()}; "
            f"it supports mergekit {', '.join(TESTED_MERGEKIT)}"
        )
    return getattr(owner, name)


def wrap(owner: Any, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]], mark: str = _MARK) -> None:
    """Replace ``owner.name`` by ``make(original)`` once; ``mark`` tells this patch's wrapper."""
    original = require(owner, name)
    if getattr(original, mark, False):
        return
    wrapper = functools.wraps(original)(make(original))
    setattr(wrapper, mark, True)
    setattr(owner, name, wrapper)
