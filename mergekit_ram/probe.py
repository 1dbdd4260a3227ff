"""``mergekit-ram probe``: a recipe's pre-pass alone, to see the task vectors before merging.

Same tensors, filters, slices and casts as the merge (the planner's own tasks), same
cache; prints per model the parameters changed, shared and unique counts, the histogram
by how many models changed each parameter, rho, and lambda under the recipe's settings.
"""

from __future__ import annotations

import math
from typing import Any

import yaml

from mergekit_ram.stats import RamStatistics, format_table


def probe_recipe(recipe_path: str, options: Any) -> RamStatistics:
    """Run only the pre-pass of a ``ram`` / ``ram_plus`` recipe; return its statistics."""
    from mergekit.config import MergeConfiguration

    from mergekit_ram.integration import plan_merge_tasks
    from mergekit_ram.parameters import METHOD_PARAMETERS, ParameterError
    from mergekit_ram.prepass import checked_context, counted_prepass

    with open(recipe_path, encoding="utf-8") as handle:
        config = MergeConfiguration.model_validate(yaml.safe_load(handle))
    if config.merge_method not in METHOD_PARAMETERS:
        raise ParameterError(
            f"probe reads ram and ram_plus recipes; this one says merge_method: {config.merge_method} "
            "(set merge_method: ram_plus to look at its task vectors)"
        )
    merge_tasks = plan_merge_tasks(config, options)
    context = checked_context(merge_tasks)
    return context.build(counted_prepass(merge_tasks, options), source="pre-pass")


def histogram_table(statistics: RamStatistics) -> str:
    """Per model: how many of its changed parameters k models changed, k = 1..N."""
    width = max(len(stats.histogram) for stats in statistics.models) if statistics.models else 0
    names = statistics.display_names()
    header = ["model"] + [f"k={k}" for k in range(1, width + 1)]
    rows = [header]
    for stats in statistics.models:
        cells = [names[stats.model]]
        for k in range(width):
            value = stats.histogram[k] if k < len(stats.histogram) else 0
            share = value / stats.active if stats.active else 0.0
            cells.append(f"{value:,} ({100 * share:.1f}%)")
        rows.append(cells)
    return format_table(rows)


def module_table(statistics: RamStatistics) -> str:
    """Density, shared, unique and local rho per part of the network and model."""
    names = statistics.display_names()
    rows = [["module", "model", "density", "changed", "shared", "unique", "local rho"]]
    for module, models in statistics.by_module().items():
        for stats in models:
            rho = "inf" if math.isinf(stats.rho) else f"{stats.rho:.4f}"
            rows.append(
                [
                    module,
                    names[stats.model],
                    f"{100 * stats.density:.2f}%",
                    f"{stats.active:,}",
                    f"{stats.shared:,}",
                    f"{stats.unique:,}",
                    rho,
                ]
            )
    return format_table(rows, left_columns=2)


def probe_json(statistics: RamStatistics, by_module: bool) -> dict[str, Any]:
    data = statistics.to_dict()
    if by_module:
        data["by_module"] = {
            module: [
                {
                    "model": stats.model,
                    "parameters": stats.numel,
                    "changed": stats.active,
                    "density": stats.density,
                    "shared": stats.shared,
                    "unique": stats.unique,
                    "overlap_histogram": {str(k + 1): v for k, v in enumerate(stats.histogram)},
                    "local_rho": stats.rho if math.isfinite(stats.rho) else None,
                }
                for stats in models
            ]
            for module, models in statistics.by_module().items()
        }
    return data
