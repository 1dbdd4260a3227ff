"""What a RAM / RAM+ merge counted and computed, as frozen values (no arithmetic beyond sums).

Built by :mod:`mergekit_ram.stats.arithmetic`, written and read by
:mod:`mergekit_ram.stats.schema`, shown by :mod:`mergekit_ram.stats.render`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Mapping, Optional, Union

from mergekit_ram.rescaling import Rescaling, rho_of_histogram

Source = Literal["pre-pass", "merge"]
#: Which per-model value the recipe set: a pinned rho or lambda (ram_plus, ram_ties), or ram_unique's scale.
Pin = Literal["rho", "lambda", "scale"]


@dataclass(frozen=True)
class TensorCounts:
    """One output tensor's overlap counts, as the kernel saw them.

    ``histograms[t][k - 1]``: elements of this tensor that ``models[t]`` changed and
    that exactly k models changed.
    """

    name: str
    numel: int
    epsilon: float
    models: tuple[str, ...]
    histograms: tuple[tuple[int, ...], ...]
    module: str = ""  # mergekit's module of the tensor in a `modules:` merge (text decoder, vision tower, ...)


@dataclass(frozen=True)
class OverlapCounts:
    """One model's counts over a set of tensors: ``histogram[k - 1]`` of its changed
    elements were changed by exactly k models."""

    model: str
    numel: int  # elements of the tensors it took part in
    histogram: tuple[int, ...]

    @property
    def active(self) -> int:
        """Elements it changed by more than epsilon."""
        return sum(self.histogram)

    @property
    def unique(self) -> int:
        return self.histogram[0] if self.histogram else 0

    @property
    def shared(self) -> int:
        return self.active - self.unique

    @property
    def density(self) -> float:
        return self.active / self.numel if self.numel else 0.0

    @property
    def measured_rho(self) -> float:
        """shared / unique as counted (inf when every change is shared)."""
        return rho_of_histogram(self.histogram)


@dataclass(frozen=True)
class ModelStatistics(OverlapCounts):
    """One fine-tuned model over the whole merge: its rho and the lambda applied to it.

    ``rho`` is ``measured_rho`` unless pinned; ``lambda_`` is the factor applied to the model's
    unique updates (ram_unique: its ``scale``); ``pinned`` says which value the recipe fixed.
    """

    rho: float
    lambda_: float
    pinned: Optional[Pin] = None


@dataclass(frozen=True)
class ModuleStatistics(OverlapCounts):
    """One model's counts over one part of the network (``module``); its ``measured_rho`` is
    local to that part and sets no lambda."""

    module: str


@dataclass(frozen=True)
class RamStatistics:
    """What a RAM / RAM+ merge computed: per-model counts, rho and lambda, and per-tensor counts.

    ``rescaling`` is None where lambda does not come from rho (``ram``, ``ram_unique``); ``epsilons``
    are the distinct epsilon values, sorted; ``density`` is ``ram_ties``'s.
    """

    method: str
    source: Source
    epsilons: tuple[float, ...]
    rescaling: Optional[Rescaling]
    models: tuple[ModelStatistics, ...]
    tensors: tuple[TensorCounts, ...]
    warnings: tuple[str, ...]
    versions: Mapping[str, str]  # mergekit-ram, mergekit, torch
    density: Optional[float] = None

    @property
    def parameters(self) -> dict[str, Any]:
        """The settings as a recipe writes them: epsilon (a list when it varies), density, r, alpha, rule."""
        epsilon: Union[float, list[float]] = self.epsilons[0] if len(self.epsilons) == 1 else list(self.epsilons)
        parameters: dict[str, Any] = {"epsilon": epsilon}
        if self.density is not None:
            parameters["density"] = self.density
        if self.rescaling is not None:
            parameters.update(r=self.rescaling.r, alpha=self.rescaling.alpha, rule=self.rescaling.rule)
        return parameters
