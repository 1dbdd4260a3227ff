"""A planned RAM merge as plain data for the checks and the cache (no mergekit here)."""

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
    """One output tensor of a planned merge; ``graph``: canonical text of its input sub-graph (cache key)."""

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
    """A recipe's model reference as written (``label``) and resolved (one model per ``key``)."""

    label: str
    path: str
    revision: Optional[str] = None
    lora_path: Optional[str] = None
    lora_revision: Optional[str] = None
    override_architecture: Optional[str] = None
    local_paths: tuple[str, ...] = ()  # paths that must exist (absolute or explicitly relative)

    @property
    def described(self) -> str:
        """The label, with an architecture override (mergekit's label leaves it out)."""
        override = f" (override_architecture {self.override_architecture})" if self.override_architecture else ""
        return self.label + override

    @property
    def key(self) -> tuple[Optional[str], ...]:
        """What tells models apart: their weights (an ``override_architecture`` reads the same ones)."""
        return (self.path, self.revision, self.lora_path, self.lora_revision)
