"""A merge's rescaling and pins, fixed once; counts to statistics; each model's lambda, once.

lambda_t is global (paper eq. 6): one r, alpha and rule per merge and one pin (or scale) per model, whatever
filters or gradients the recipe uses; ram_ties's density is one value too. Plain data; no torch, no mergekit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping, NamedTuple, Optional, Sequence

from mergekit_ram.parameters import METHOD_NAMES, ParameterError
from mergekit_ram.rescaling import Rescaling
from mergekit_ram.stats.arithmetic import build_statistics, model_lambda
from mergekit_ram.stats.data import PIN_KINDS, Pin, RamStatistics, Source, TensorCounts


class Resolved(NamedTuple):
    """A method's parameters for one tensor (or group): ``shared`` by name, ``per_model``: model -> name -> value."""

    name: str
    shared: Mapping[str, Any]
    per_model: Mapping[str, Mapping[str, Any]]


class Applied(NamedTuple):
    """One model's lambda_t as applied, and the rho it came from (None where lambda was pinned)."""

    lambda_: float
    rho: Optional[float]


@dataclass(frozen=True)
class MergeRule:
    """What turns counts into statistics and rho into lambda, fixed once per merge: ``rescaling`` None where
    lambda does not come from rho (``ram``: 1; ``ram_unique``: the scales); ``pins``: (model, kind, value)."""

    method: str
    rescaling: Optional[Rescaling] = None
    pins: tuple[tuple[str, Pin, float], ...] = ()
    density: Optional[float] = None

    def pin(self, model: str) -> Optional[tuple[Pin, float]]:
        return next(((kind, value) for name, kind, value in self.pins if name == model), None)

    def needs_counts(self, finetunes: Iterable[str]) -> bool:
        """Whether some lambda depends on a global rho: r > 0 and a model with nothing pinned."""
        rescaling = self.rescaling
        return rescaling is not None and rescaling.r != 0 and any(self.pin(model) is None for model in finetunes)

    def applied(self, finetunes: Sequence[str], statistics: Optional[RamStatistics]) -> dict[str, Applied]:
        """Each model's lambda as applied and its rho (None for a pinned lambda or scale); no counts: from pins."""
        if statistics is not None:
            return {
                stats.model: Applied(stats.lambda_, None if stats.pinned in ("lambda", "scale") else stats.rho)
                for stats in statistics.models
            }
        applied = {}
        for model in finetunes:
            pin = self.pin(model)
            if pin is None and self.rescaling is not None and self.rescaling.r != 0:
                raise ValueError(f"lambda of {model} needs its global rho")
            rho = pin[1] if pin is not None and pin[0] == "rho" else None
            applied[model] = Applied(model_lambda(0.0, self.rescaling, pin), rho)
        return applied

    def statistics(
        self,
        tensors: Iterable[TensorCounts],
        source: Source,
        checkpoint_dtypes: Optional[Mapping[str, Iterable[str]]] = None,
        modules: Optional[Mapping[str, str]] = None,
    ) -> RamStatistics:
        return build_statistics(
            self.method,
            tensors,
            rescaling=self.rescaling,
            pins={model: (kind, value) for model, kind, value in self.pins},
            source=source,
            checkpoint_dtypes=checkpoint_dtypes,
            density=self.density,
            modules=modules,
        )


def merge_rule(method: str, tensors: Sequence[Resolved], defaults: Mapping[str, Any]) -> MergeRule:
    """The one MergeRule of a merge: each whole-merge parameter (``defaults``: their names and defaults, epsilon
    aside), and each model's pin, one value."""
    if method not in METHOD_NAMES:
        raise ValueError(f"not a mergekit-ram method: {method!r}")
    values = {}
    for name, default in defaults.items():
        value = _one_value(method, name, [(tensor.name, tensor.shared.get(name)) for tensor in tensors])
        values[name] = default if value is None else value
    rescaling = Rescaling(values["r"], values["alpha"], values["rule"]) if "r" in values else None
    return MergeRule(method=method, rescaling=rescaling, pins=_pins(method, tensors), density=values.get("density"))


def _pins(method: str, tensors: Sequence[Resolved]) -> tuple[tuple[str, Pin, float], ...]:
    """(model, kind, value) for each model that sets its lambda, else its rho, or its scale (ram_unique)."""
    pins = []
    for model in dict.fromkeys(model for tensor in tensors for model in tensor.per_model):
        seen: dict[tuple[Pin, Any], str] = {}
        for tensor in tensors:
            own = tensor.per_model.get(model)
            if own is not None:
                kind: Pin = next((k for k in PIN_KINDS if own.get(k) is not None), "rho")
                seen.setdefault((kind, own.get(kind)), tensor.name)
        if len(seen) > 1:
            (first, first_tensor), (second, second_tensor) = list(seen.items())[:2]
            raise ParameterError(
                f"{method}: the {'' if first[0] == 'scale' else 'pinned '}{first[0]} of {model} must be one value "
                "for the whole merge; "
                f"got {first[1]!r} for {first_tensor} and {second[0]}={second[1]!r} for {second_tensor}"
            )
        ((kind, value),) = seen
        if value is not None:
            pins.append((model, kind, float(value)))
    return tuple(pins)


def _one_value(method: str, name: str, values: Sequence[tuple[str, Any]]) -> Any:
    """The single value a whole-merge parameter has over the tensors; None when there are none."""
    seen: dict[Any, str] = {}
    for tensor, value in values:
        seen.setdefault(value, tensor)
    if len(seen) > 1:
        (first, first_tensor), (second, second_tensor) = list(seen.items())[:2]
        raise ParameterError(
            f"{method}: parameter {name!r} must be one value for the whole merge (it sets lambda_t or the shared "
            f"region's rule, paper eq. 6); got {first!r} for {first_tensor} and {second!r} for {second_tensor}"
        )
    return next(iter(seen), None)
