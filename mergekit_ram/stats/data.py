"""What a RAM merge counted and computed, as frozen values (no arithmetic beyond sums)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Mapping, Optional, Union

from mergekit_ram.rescaling import Rescaling, rho_of_histogram

Source = Literal["pre-pass", "merge"]
#: Which per-model value the recipe set: a pinned rho or lambda (ram_plus, ram_ties), or ram_unique's scale.
Pin = Literal["rho", "lambda", "scale"]
#: A model's pin is the first of these it sets (no method declares ``scale`` beside ``lambda`` or ``rho``).
PIN_KINDS: tuple[Pin, ...] = ("lambda", "rho", "scale")


@dataclass(frozen=True)
class TensorCounts:
    """One output tensor: ``histograms[t][k - 1]`` elements ``models[t]`` changed that exactly k models
    changed; ``module`` is mergekit's module of the tensor in a ``modules:`` merge."""

    name: str
    numel: int
    epsilon: float
    models: tuple[str, ...]
    histograms: tuple[tuple[int, ...], ...]
    module: str = ""


@dataclass(frozen=True)
class OverlapCounts:
    """One model over some tensors: ``numel`` their elements, ``histogram[k - 1]`` its changes k models made."""

    model: str
    numel: int
    histogram: tuple[int, ...]

    @property
    def active(self) -> int:
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
        return rho_of_histogram(self.histogram)


@dataclass(frozen=True)
class ModelStatistics(OverlapCounts):
    """One model over the merge: ``rho`` (``measured_rho`` unless pinned), ``lambda_`` (ram_unique: its scale)."""

    rho: float
    lambda_: float
    pinned: Optional[Pin] = None


@dataclass(frozen=True)
class RamStatistics:
    """A merge's statistics; ``rescaling`` None where lambda does not come from rho (``ram``, ``ram_unique``)."""

    method: str
    source: Source
    epsilons: tuple[float, ...]
    rescaling: Optional[Rescaling]
    models: tuple[ModelStatistics, ...]
    tensors: tuple[TensorCounts, ...]
    warnings: tuple[str, ...]
    versions: Mapping[str, str]
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
