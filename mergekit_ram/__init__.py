"""mergekit-ram: Reinforced Agent Merging (RAM, RAM+) for mergekit.

Importing this package is cheap (no torch, no mergekit); the heavy parts load on use.
"""

from mergekit_ram._version import __version__

_LAZY = {
    "register": "mergekit_ram.integration",
    "merge_state_dicts": "mergekit_ram.integration.inmemory",
    "RamStatistics": "mergekit_ram.stats",
    "TensorCounts": "mergekit_ram.stats.data",
    "ParameterError": "mergekit_ram.parameters",
}


def __getattr__(name: str) -> object:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'mergekit_ram' has no attribute {name!r}")


__all__ = ["__version__", *_LAZY]
