"""A planned RAM merge as plain data: what the checks, the cache and the statistics need.

The mergekit boundary (``mergekit_ram.integration``) describes each of the planner's merge
tasks as a ``PlannedTensor`` and each recipe model as a ``ModelIdentity``; nothing here
imports mergekit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class TensorInput:
    """One model's input to a merged tensor: the file holding it (None: the model lacks it)."""

    model: str
    file: Optional[str]
    name: str


@dataclass(frozen=True)
class PlannedTensor:
    """One output tensor of a planned RAM merge, as the kernel will see it.

    ``graph`` is a canonical text of the sub-graph that loads its inputs (models, names after
    slicing and remapping, casts, tokenizer alignment, LoRA): the cache key's part.
    """

    name: str
    optional: bool
    vocabulary_axis: Optional[int]
    reshaped: bool  # tokenizer alignment or truncation reshapes the vocabulary axis first
    base: str
    finetunes: tuple[str, ...]
    inputs: tuple[TensorInput, ...]
    epsilon: float
    graph: str


@dataclass(frozen=True)
class ModelIdentity:
    """A recipe's model reference: how it is written (``label``) and what it resolves to.

    ``path`` is the real path of a local model or the Hub id; two references are one model
    when ``key`` matches.
    """

    label: str
    path: str
    revision: Optional[str] = None
    lora_path: Optional[str] = None
    lora_revision: Optional[str] = None
    override_architecture: Optional[str] = None
    local_paths: tuple[str, ...] = ()  # paths that must exist (absolute or explicitly relative)

    @property
    def key(self) -> tuple[Optional[str], ...]:
        return (self.path, self.revision, self.lora_path, self.lora_revision, self.override_architecture)
