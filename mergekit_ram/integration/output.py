"""``run_merge`` and ``mergekit-pytorch`` write a RAM merge through an output transaction.

mergekit's own ``run_merge`` (so ``mergekit-yaml`` and every stage of ``mergekit-multi``) and the
``mergekit-pytorch`` command write into the staging folder of ``mergekit_ram.staging``'s
output transaction: weights, config, tokenizer, card and statistics reach the output folder
together, or not at all. An output folder that is an input's folder is refused first. The
statistics come back in the merge's ``RamRun`` for the card and the terminal. Other methods run
exactly as mergekit has them.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Callable, Iterator, Optional

import yaml

from mergekit_ram import staging
from mergekit_ram.integration.internals import MergekitMovedError, check_internals, internal, wrap
from mergekit_ram.integration.planner import RamRun, attach_ram_plan, with_run
from mergekit_ram.integration.recipes import check_recipe_file
from mergekit_ram.integration.registry import is_ours
from mergekit_ram.published import append_card_section, report_summary

MergeOptions: Any = internal("mergekit.options", "MergeOptions")
RawPyTorchMergeConfig: Any = internal("mergekit.scripts.merge_raw_pytorch", "RawPyTorchMergeConfig")
plan_flat_merge: Any = internal("mergekit.scripts.merge_raw_pytorch", "plan_flat_merge")
Executor: Any = internal("mergekit.graph", "Executor")


def patch_run_merge(merge: Any) -> None:
    """RAM merges: inputs' folders refused, the recipe checked once, everything staged and published at once."""

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def run_merge(merge_config: Any, out_path: str, options: Any, config_source: Optional[str] = None) -> Any:
            if not is_ours(merge_config.merge_method):
                return original(merge_config, out_path, options=options, config_source=config_source)
            check_internals()
            staging.refuse_input_folder(out_path, _model_folders(merge_config))
            run = RamRun.checked(merge_config, options, config_source)
            with staging.output_transaction(out_path) as staged:
                result = original(merge_config, staged, options=with_run(options, run), config_source=config_source)
                if not os.path.isdir(staged):
                    raise MergekitMovedError(
                        f"mergekit moved its output out of {staged} (an architecture with post_fill_parameters); "
                        "mergekit-ram cannot publish it"
                    )
                if options.write_model_card and run.statistics is not None:
                    append_card_section(staged, run.statistics)
            if not options.quiet and run.statistics is not None:
                report_summary(out_path, run.statistics)
            return result

        return run_merge

    wrap("mergekit.merge", "run_merge", make)
    patched = internal("mergekit.merge", "run_merge")
    for name in ("mergekit.scripts.run_yaml", "mergekit.scripts.multimerge"):
        module = sys.modules.get(name)
        if module is not None and getattr(module, "run_merge", None) is not patched:
            module.run_merge = patched  # type: ignore[attr-defined]  # imported by name before the patch


def _model_folders(merge_config: Any) -> Iterator[tuple[str, str]]:
    """(model as the recipe names it, local folder) for every model and LoRA the recipe reads."""
    for model in merge_config.referenced_models():
        for reference in (model.model, model.lora):
            if reference is not None:
                yield str(model), os.path.expanduser(reference.path)


def patch_raw_pytorch(raw: Any) -> None:
    """``mergekit-pytorch``'s command: unknown keys refused, inputs' folders refused, output transaction.

    For a RAM recipe the command's own steps run here (its options are built inside the command,
    so this is the only way its planning gets the merge's ``RamRun``), with mergekit's functions.
    """

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def command(*args: Any, **kwargs: Any) -> Any:
            check_recipe_file(kwargs.get("config_path"), RawPyTorchMergeConfig)
            config = _raw_config(kwargs.get("config_path"))
            if args or config is None or "out_path" not in kwargs or not is_ours(config.merge_method):
                return original(*args, **kwargs)
            check_internals()
            out_path = kwargs["out_path"]
            files = [entry.model for entry in config.models] + ([config.base_model] if config.base_model else [])
            folders = [(file, os.path.dirname(os.path.abspath(file))) for file in files]
            folders += [(file, os.path.dirname(os.path.realpath(file))) for file in files]
            folders += [(file, file) for file in files if os.path.isdir(file)]
            staging.refuse_input_folder(out_path, folders)
            options = MergeOptions(**{key: kwargs[key] for key in MergeOptions.model_fields if key in kwargs})
            run = RamRun.checked(config, options)
            options.apply_global_options()
            with staging.output_transaction(out_path) as staged:
                union, intersection = kwargs["tensor_union"], kwargs["tensor_intersection"]
                targets = attach_ram_plan(
                    plan_flat_merge(config, staged, union, intersection, options), options, staged, run
                )
                storage = options.device if options.low_cpu_memory else "cpu"
                Executor(targets, math_device=options.device, storage_device=storage).execute()
            if not options.quiet and run.statistics is not None:
                report_summary(out_path, run.statistics)

        return command

    wrap("mergekit.scripts.merge_raw_pytorch", "main.callback", make)


def _raw_config(path: Optional[str]) -> Any:
    """The ``mergekit-pytorch`` recipe at ``path``, or None (mergekit then reports the problem)."""
    try:
        with open(str(path), encoding="utf-8") as handle:
            return RawPyTorchMergeConfig.model_validate(yaml.safe_load(handle))
    except Exception:  # noqa: BLE001 - mergekit's own code reads it again and says what is wrong
        return None
