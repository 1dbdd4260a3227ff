"""``mergekit-ram probe``: a recipe's pre-pass alone, to see the task vectors before merging.

Same tensors, filters, slices, casts and cache as the merge (the planner's own tasks); a mergekit-multi
file is read as mergekit-multi reads it: every RAM stage, or the one named.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Mapping, NamedTuple, Optional

from mergekit_ram.stats.data import RamStatistics
from mergekit_ram.stats.schema import statistics_to_dict

if TYPE_CHECKING:
    from mergekit_ram.integration.recipes import Stage


class ProbeSelection(NamedTuple):
    """The stages of a recipe file to probe, and one line for each RAM stage that cannot be yet."""

    stages: tuple[Stage, ...]
    not_probed: tuple[str, ...]
    single: bool  # one recipe (one document, or one stage chosen by name): reported as before


def select_stages(recipe_path: str, stage_name: Optional[str] = None, intermediate_dir: str = "") -> ProbeSelection:
    """The mergekit-ram stages of a recipe file whose inputs exist (an earlier stage's under ``intermediate_dir``)."""
    from mergekit_ram.errors import RecipeError
    from mergekit_ram.integration.recipes import check_method_name, read_stages, stage_output
    from mergekit_ram.parameters import METHOD_NAMES, ParameterError

    stages = read_stages(recipe_path, intermediate_dir)
    candidates = stages
    if stage_name is not None:
        candidates = [stage for stage in stages if stage.name == stage_name]
        if not candidates:
            raise RecipeError(
                f"{recipe_path} has no stage named {stage_name!r}; its stages: "
                + ", ".join(stage.label for stage in stages)
            )
    for stage in candidates:
        check_method_name(stage.config.merge_method)
    ram_stages = [stage for stage in candidates if stage.config.merge_method in METHOD_NAMES]
    if not ram_stages:
        methods = ", ".join(dict.fromkeys(stage.config.merge_method for stage in candidates))
        raise ParameterError(
            f"probe reads mergekit-ram recipes ({', '.join(METHOD_NAMES)}); this one says merge_method: {methods} "
            "(set merge_method: ram_plus to look at its task vectors)"
        )
    ready, not_probed = [], []
    for stage in ram_stages:
        missing = [name for name in stage.depends_on if stage_output(intermediate_dir, name) is None]
        if not missing:
            ready.append(stage)
            continue
        where = (
            f"nothing is at {os.path.join(intermediate_dir, missing[0])}"
            if intermediate_dir
            else "then give the probe mergekit-multi's --intermediate-dir"
        )
        not_probed.append(
            f"stage {stage.label} cannot be probed yet: it merges the output of stage {missing[0]}, "
            f"which exists only once mergekit-multi has run that stage ({where})"
        )
    if not ready:
        raise RecipeError(not_probed[0])
    return ProbeSelection(tuple(ready), tuple(not_probed), stage_name is not None or len(stages) == 1)


def probe_options(arguments: Mapping[str, Any], quiet: bool) -> Any:
    """mergekit's MergeOptions of the probe's options (the device checked, the threads set), the methods
    registered (refused in one line first where the plugin cannot run with the installed mergekit)."""
    from mergekit_ram.errors import MergekitMovedError
    from mergekit_ram.integration import register
    from mergekit_ram.integration.internals import internal, unsupported

    refusal = unsupported()
    if refusal is not None:
        raise MergekitMovedError(refusal)
    from mergekit_ram.integration.merge import check_setting

    register()
    options = internal("mergekit.options", "MergeOptions")(**arguments, quiet=quiet)
    check_setting(options)
    if options.num_threads is not None:
        import torch

        torch.set_num_threads(options.num_threads)
    return options


def probe_stages(selection: ProbeSelection, options: Any, refresh: bool) -> list[tuple[Stage, RamStatistics]]:
    """Each selected stage's statistics: its checks and pre-pass alone."""
    return [(stage, probe_config(stage.config, options, refresh)) for stage in selection.stages]


def probe_config(config: Any, options: Any, refresh: bool = False) -> RamStatistics:
    """The statistics of a RAM MergeConfiguration's checks and pre-pass alone, the methods registered."""
    from mergekit_ram.integration import register
    from mergekit_ram.integration.merge import probe_statistics

    register()
    return probe_statistics(config, options, refresh)


def stage_plot_path(path: str, stage: Stage, selection: ProbeSelection) -> str:
    """``--plot`` PATH for one recipe; ``PATH-stem.<stage>.png`` per stage of a multi-stage file."""
    if selection.single:
        return path
    root, extension = os.path.splitext(path)
    return f"{root}.{stage.name or 'final'}{extension or '.png'}"


def probe_report_json(
    selection: ProbeSelection, reports: list[tuple[Stage, RamStatistics]], by_module: bool
) -> dict[str, Any]:
    """One recipe: its statistics; a multi-stage file: ``{"stages": {name: ...}, "not_probed": [...]}``."""
    if selection.single:
        return statistics_to_dict(reports[0][1], with_modules=by_module)
    return {
        "stages": {
            stage.name or "final": statistics_to_dict(statistics, with_modules=by_module)
            for stage, statistics in reports
        },
        "not_probed": list(selection.not_probed),
    }
