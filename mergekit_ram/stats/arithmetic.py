"""From per-tensor counts to a merge's statistics: sums per model, rho_t over every tensor, lambda_t from
:func:`model_lambda` alone (so the lambda reported is the one applied), the warnings."""

from __future__ import annotations

import importlib.metadata
from dataclasses import replace
from itertools import zip_longest
from typing import Callable, Iterable, Mapping, Optional, Sequence

from mergekit_ram.rescaling import PLAUSIBLE_LAMBDA, Rescaling
from mergekit_ram.stats.data import ModelStatistics, OverlapCounts, Pin, RamStatistics, Source, TensorCounts

#: The parts of a network ``module_of`` tells apart, in the order they are shown.
MODULES = ("embeddings", "attention", "mlp", "norms", "output head", "other")
#: Above this density for every model, RAM's premise (sparse updates) does not hold.
DENSE = 0.9


def model_lambda(rho: float, rescaling: Optional[Rescaling], pin: Optional[tuple[Pin, float]] = None) -> float:
    """lambda_t: a pinned lambda (or ram_unique's scale) as is; else the rule on rho_t or the pinned rho; 1 for RAM."""
    if pin is not None and pin[0] in ("lambda", "scale"):
        return pin[1]
    if rescaling is None:
        return 1.0
    return rescaling.lambda_(pin[1] if pin is not None else rho)


def sum_counts(tensors: Iterable[TensorCounts]) -> dict[str, OverlapCounts]:
    """Per model, in order of first appearance: elements considered and the histogram, summed over tensors."""
    summed: dict[str, tuple[int, list[int]]] = {}
    for counts in tensors:
        for model, row in zip(counts.models, counts.histograms):
            numel, total = summed.get(model, (0, []))
            summed[model] = (numel + counts.numel, [a + b for a, b in zip_longest(total, row, fillvalue=0)])
    return {model: OverlapCounts(model, numel, tuple(total)) for model, (numel, total) in summed.items()}


def build_statistics(
    method: str,
    tensors: Iterable[TensorCounts],
    *,
    rescaling: Optional[Rescaling],
    pins: Optional[Mapping[str, tuple[Pin, float]]] = None,
    source: Source = "pre-pass",
    checkpoint_dtypes: Optional[Mapping[str, Iterable[str]]] = None,
    density: Optional[float] = None,
    modules: Optional[Mapping[str, str]] = None,
) -> RamStatistics:
    """Counts summed per model, then rho_t and lambda_t (pins override; a pinned model without counts comes
    last); ``checkpoint_dtypes`` (safetensors dtype names per model) only feeds the warnings."""
    # Each output tensor once: mergekit 0.1.5 plans some twice (qwen2_vl's projector "layers" share names).
    named = {counts.name: replace(counts, module=(modules or {}).get(counts.name, counts.module)) for counts in tensors}
    tensors = tuple(named.values())
    pins = pins or {}
    summed = sum_counts(tensors)
    models = []
    for model in dict.fromkeys([*summed, *pins]):
        counts = summed.get(model, OverlapCounts(model, 0, ()))
        pinned, value = pins.get(model, (None, 0.0))
        rho = value if pinned == "rho" else counts.measured_rho
        lambda_ = model_lambda(counts.measured_rho, rescaling, pins.get(model))
        models.append(ModelStatistics(model, counts.numel, counts.histogram, rho, lambda_, pinned))
    epsilons = tuple(sorted({counts.epsilon for counts in tensors}))
    warnings = _warnings(models, epsilons, checkpoint_dtypes or {})
    return RamStatistics(
        method, source, epsilons, rescaling, tuple(models), tensors, warnings, package_versions(), density
    )


def by_module(statistics: RamStatistics) -> dict[str, tuple[OverlapCounts, ...]]:
    """The counts per part of the network (``MODULES`` order), within each module of a ``modules:`` merge."""
    order = {part: index for index, part in enumerate(MODULES)}
    tensors = sorted(statistics.tensors, key=lambda counts: (counts.module, order[module_of(counts.name)]))
    return _grouped(tensors, lambda counts: ": ".join(filter(None, (counts.module, module_of(counts.name)))))


def by_merged_module(statistics: RamStatistics) -> dict[str, tuple[OverlapCounts, ...]]:
    """The counts per module of a ``modules:`` merge, in recipe order; empty for a merge of one module."""
    if len({counts.module for counts in statistics.tensors}) < 2:
        return {}
    return _grouped(statistics.tensors, lambda counts: counts.module)


def _grouped(
    tensors: Iterable[TensorCounts], group_of: Callable[[TensorCounts], str]
) -> dict[str, tuple[OverlapCounts, ...]]:
    groups: dict[str, list[TensorCounts]] = {}
    for counts in tensors:
        groups.setdefault(group_of(counts), []).append(counts)
    return {group: tuple(sum_counts(members).values()) for group, members in groups.items()}


def module_of(name: str) -> str:
    """The part of a transformer a tensor belongs to, from its name."""
    lowered = name.lower()
    if "lm_head" in lowered or lowered.startswith("output.") or "embed_out" in lowered:
        return "output head"
    if "embed" in lowered or ".wte." in lowered or ".wpe." in lowered:
        return "embeddings"
    if "norm" in lowered or ".ln_" in lowered or "layernorm" in lowered:
        return "norms"
    if "attn" in lowered or "attention" in lowered:
        return "attention"
    if "mlp" in lowered or "feed_forward" in lowered or "experts" in lowered or ".ffn" in lowered:
        return "mlp"
    return "other"


def _warnings(
    models: Sequence[ModelStatistics], epsilons: Sequence[float], checkpoint_dtypes: Mapping[str, Iterable[str]]
) -> tuple[str, ...]:
    """The statistics that predict a wasted merge, in words."""
    found = []
    half = sorted(model for model, dtypes in checkpoint_dtypes.items() if "F16" in set(dtypes))
    if half and any(epsilon > 0 for epsilon in epsilons):
        found.append(
            f"float16 checkpoints ({', '.join(half)}): a one-ulp change is below epsilon={max(epsilons):g} for "
            "|w| < about 0.016, so epsilon hides many real float16 updates; consider a smaller epsilon "
            "(see docs/method.md)"
        )
    mixed = {model: sorted(set(dtypes)) for model, dtypes in checkpoint_dtypes.items()}
    if len({tuple(dtypes) for dtypes in mixed.values()}) > 1:
        listing = ", ".join(f"{model}: {'/'.join(dtypes)}" for model, dtypes in sorted(mixed.items()))
        found.append(
            f"the checkpoints are stored in different dtypes ({listing}): rounding alone makes elements look "
            "changed, so densities and overlaps are inflated; convert them to one dtype first"
        )
    counted = [stats for stats in models if stats.numel]
    if counted and all(stats.density >= DENSE for stats in counted):
        densities = ", ".join(f"{100 * stats.density:.0f}%" for stats in counted)
        found.append(
            f"every model changed at least {100 * DENSE:.0f}% of its parameters ({densities}): RAM's premise of "
            "sparse, mostly disjoint updates does not hold here; TIES or DARE suit dense task vectors better"
        )
    for stats in models:
        if stats.lambda_ > PLAUSIBLE_LAMBDA:
            found.append(
                f"{stats.model}: lambda {stats.lambda_:g} is implausibly large (the paper's are about 1.2; "
                f"above {PLAUSIBLE_LAMBDA:g} its unique updates are applied more than {PLAUSIBLE_LAMBDA:g}-fold): "
                "check r and alpha, or the pinned lambda"
            )
    copies = [stats.model for stats in counted if stats.active and not stats.unique]
    if len(copies) > 1:
        found.append(
            f"{', '.join(copies)} have no unique change at all (every parameter each changed, another model "
            "changed too; rho is inf): copies of one model under different paths look like this; list each "
            "model once, or check the paths"
        )
    for stats in counted:
        if stats.active == 0:
            found.append(
                f"{stats.model} changed no parameter by more than epsilon: is it the base model itself, "
                "or a wrong path?"
            )
    return tuple(found)


def package_versions() -> dict[str, str]:
    """The versions a statistics file records (and the pre-pass cache key includes)."""
    versions = {}
    for name in ("mergekit-ram", "mergekit", "torch"):
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = "not installed"
    return versions
