"""A RAM merge's settings, validated once: the rescaling (r, alpha, rule), the pins, and lambda.

lambda_t is global (paper eq. 6): one r, one alpha, one rule per merge and one pin per model,
whatever filters or gradients the recipe uses. ``merge_settings`` checks that over every
tensor of the merge and returns the one ``MergeSettings`` that turns rho into lambda for the
pre-pass, the kernel and the statistics alike. Plain data; no torch, no mergekit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, NamedTuple, Optional, Sequence

from mergekit_ram.parameters import ALPHA, RULE, ParameterError, R
from mergekit_ram.planned import TensorParameters
from mergekit_ram.rescaling import Rescaling
from mergekit_ram.stats import Pin, RamStatistics, Source, TensorCounts, build_statistics, model_lambda

RAM_METHODS = ("ram", "ram_plus")


class Applied(NamedTuple):
    """One model's lambda_t as applied, and the rho it came from (None where lambda was pinned)."""

    lambda_: float
    rho: Optional[float]


@dataclass(frozen=True)
class MergeSettings:
    """What turns counts into statistics and rho into lambda, fixed once per merge.

    ``rescaling`` is None for ``ram`` (every lambda is 1). ``pins``: (model, "rho" or
    "lambda", value) as the recipe set them.
    """

    method: str
    rescaling: Optional[Rescaling] = None
    pins: tuple[tuple[str, Pin, float], ...] = ()
    checkpoint_dtypes: tuple[tuple[str, tuple[str, ...]], ...] = ()

    def pin(self, model: str) -> Optional[tuple[Pin, float]]:
        return next(((kind, value) for name, kind, value in self.pins if name == model), None)

    def needs_counts(self, finetunes: Iterable[str]) -> bool:
        """Whether some lambda depends on a global rho: ram_plus, r > 0, a model with nothing pinned."""
        if self.rescaling is None or self.rescaling.r == 0:
            return False
        return any(self.pin(model) is None for model in finetunes)

    def model_lambda(self, model: str, rho: Optional[float]) -> float:
        """lambda_t through the statistics' one rule (``stats.model_lambda``): the pinned lambda,
        else the rescaling of the pinned or given rho; 1 for ``ram``.

        ``rho`` may be None only where lambda does not depend on it (see ``needs_counts``).
        """
        pin = self.pin(model)
        if rho is None and pin is None and self.rescaling is not None:
            if self.rescaling.r != 0:
                raise ValueError(f"lambda of {model} needs its global rho")
            rho = 0.0  # r = 0: every rho gives lambda 1
        return model_lambda(0.0 if rho is None else rho, self.rescaling, pin)

    def lambdas_without_counts(self, finetunes: Sequence[str]) -> Optional[dict[str, float]]:
        """Each model's lambda when no count is needed (ram, r = 0, every model pinned); else None."""
        if self.needs_counts(finetunes):
            return None
        return {model: self.model_lambda(model, None) for model in finetunes}

    def applied(self, finetunes: Sequence[str], statistics: Optional[RamStatistics]) -> dict[str, Applied]:
        """Each model's lambda as the kernel is to apply it, with the rho it came from (None for a
        pinned lambda); from ``statistics`` when counts were needed, else from the pins alone.

        None for ``ram``, which has no lambda.
        """
        if self.rescaling is None:
            return {}
        if statistics is not None:
            return {
                stats.model: Applied(stats.lambda_, None if stats.pinned == "lambda" else stats.rho)
                for stats in statistics.models
            }
        applied = {}
        for model in finetunes:
            pin = self.pin(model)
            applied[model] = Applied(self.model_lambda(model, None), pin[1] if pin and pin[0] == "rho" else None)
        return applied

    def statistics(self, tensors: Iterable[TensorCounts], source: Source) -> RamStatistics:
        """Per-model counts, rho and lambda (through ``model_lambda``) from per-tensor counts."""
        return build_statistics(
            self.method,
            tensors,
            rescaling=self.rescaling,
            pins={model: (kind, value) for model, kind, value in self.pins},
            source=source,
            checkpoint_dtypes=dict(self.checkpoint_dtypes),
        )


def merge_settings(
    method: str, tensors: Sequence[TensorParameters], checkpoint_dtypes: Optional[dict[str, set[str]]] = None
) -> MergeSettings:
    """The one MergeSettings of a merge whose tensors were resolved to ``tensors``.

    r, alpha and rule must be one value per merge, and each model's pin one value.
    """
    if method not in RAM_METHODS:
        raise ValueError(f"not a mergekit-ram method: {method!r}")
    dtypes = tuple((model, tuple(sorted(found))) for model, found in sorted((checkpoint_dtypes or {}).items()))
    if method == "ram":
        return MergeSettings(method=method, checkpoint_dtypes=dtypes)
    values = {
        name: _one_value(name, [(tensor.name, tensor.value(name)) for tensor in tensors])
        for name in ("r", "alpha", "rule")
    }
    pins = []
    for model in dict.fromkeys(pin.model for tensor in tensors for pin in tensor.pins):
        seen: dict[tuple[Pin, Any], str] = {}
        for tensor in tensors:
            for pin in tensor.pins:
                if pin.model == model:
                    key: tuple[Pin, Any] = ("lambda", pin.lambda_) if pin.lambda_ is not None else ("rho", pin.rho)
                    seen.setdefault(key, tensor.name)
        if len(seen) > 1:
            (first, first_tensor), (second, second_tensor) = list(seen.items())[:2]
            raise ParameterError(
                f"ram_plus: the pinned {first[0]} of {model} must be one value for the whole merge; "
                f"got {first[1]!r} for {first_tensor} and {second[0]}={second[1]!r} for {second_tensor}"
            )
        ((kind, value),) = seen
        if value is not None:
            pins.append((model, kind, float(value)))
    rescaling = Rescaling(
        r=R.default if values["r"] is None else values["r"],
        alpha=ALPHA.default if values["alpha"] is None else values["alpha"],
        rule=RULE.default if values["rule"] is None else values["rule"],
    )
    return MergeSettings(method=method, rescaling=rescaling, pins=tuple(pins), checkpoint_dtypes=dtypes)


def _one_value(name: str, values: Sequence[tuple[str, Any]]) -> Any:
    """The single value a whole-merge parameter has over the tensors; None when there are none."""
    seen: dict[Any, str] = {}
    for tensor, value in values:
        seen.setdefault(value, tensor)
    if len(seen) > 1:
        (first, first_tensor), (second, second_tensor) = list(seen.items())[:2]
        raise ParameterError(
            f"ram_plus: parameter {name!r} must be one value for the whole merge (lambda_t is global, "
            f"paper eq. 6); got {first!r} for {first_tensor} and {second!r} for {second_tensor}"
        )
    return next(iter(seen), None)
