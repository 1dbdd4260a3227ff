"""``run_merge`` and ``mergekit-pytorch`` write a RAM merge through an output transaction.

mergekit's own ``run_merge`` (so ``mergekit-yaml`` and every stage of ``mergekit-multi``) and the
``mergekit-pytorch`` command write into the staging folder of ``mergekit_ram.staging``'s
output transaction: weights, config, tokenizer, card and statistics reach the output folder
together, or not at all. An output folder that is an input's folder is refused first.
Other methods run exactly as mergekit has them.
"""

from __future__ import annotations

import os
import sys
from types import ModuleType
from typing import Any, Callable, Iterator, Optional

import yaml

from mergekit_ram import staging
from mergekit_ram.checks import HeaderCache
from mergekit_ram.integration.planner import checked_options, patch_flat_plan
from mergekit_ram.integration.recipes import check_config, check_recipe_file
from mergekit_ram.integration.registry import is_ours
from mergekit_ram.integration.versions import MergekitMovedError, require, wrap
from mergekit_ram.published import append_card_section, report_summary


def patch_run_merge(merge: ModuleType) -> None:
    """RAM merges: inputs' folders refused, the recipe checked once, everything staged and published at once."""

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def run_merge(merge_config: Any, out_path: str, options: Any, config_source: Optional[str] = None) -> Any:
            if not is_ours(merge_config.merge_method):
                return original(merge_config, out_path, options=options, config_source=config_source)
            staging.refuse_input_folder(out_path, _model_folders(merge_config))
            headers = HeaderCache()
            check_config(
                merge_config.merge_method, merge_config, headers, config_source, allow_crimes=options.allow_crimes
            )
            planned_options = checked_options(options, headers)
            with staging.output_transaction(out_path) as staged:
                result = original(merge_config, staged, options=planned_options, config_source=config_source)
                if not os.path.isdir(staged):
                    raise MergekitMovedError(
                        f"mergekit moved its output out of {staged} (an architecture with post_fill_parameters); "
                        "mergekit-ram cannot publish it"
                    )
                if options.write_model_card:
                    append_card_section(staged)
            if not options.quiet:
                report_summary(out_path)
            return result

        return run_merge

    wrap(merge, "run_merge", make)
    patched = require(merge, "run_merge")
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


def patch_raw_pytorch(raw: ModuleType) -> None:
    """``mergekit-pytorch``: its flat plan (checks, pre-pass) and its command (output transaction)."""
    patch_flat_plan(raw)
    patch_raw_pytorch_command(raw)


def patch_raw_pytorch_command(raw: ModuleType) -> None:
    """``mergekit-pytorch``'s command: unknown keys refused, inputs' folders refused, output transaction.

    A RAM recipe (read once more here, a few bytes) runs inside an output transaction whose
    staging folder is the ``out_path`` mergekit sees.
    """

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def command(*args: Any, **kwargs: Any) -> Any:
            check_recipe_file(kwargs.get("config_path"), require(raw, "RawPyTorchMergeConfig"))
            config = _raw_config(raw, kwargs.get("config_path"))
            if args or config is None or "out_path" not in kwargs or not is_ours(config.merge_method):
                return original(*args, **kwargs)
            out_path = kwargs["out_path"]
            files = [entry.model for entry in config.models] + ([config.base_model] if config.base_model else [])
            folders = [(file, os.path.dirname(os.path.abspath(file))) for file in files]
            folders += [(file, os.path.dirname(os.path.realpath(file))) for file in files]
            folders += [(file, file) for file in files if os.path.isdir(file)]
            staging.refuse_input_folder(out_path, folders)
            with staging.output_transaction(out_path) as staged:
                return original(**{**kwargs, "out_path": staged})

        return command

    wrap(require(raw, "main"), "callback", make)


def _raw_config(raw: ModuleType, path: Optional[str]) -> Any:
    """The ``mergekit-pytorch`` recipe at ``path``, or None (mergekit then reports the problem)."""
    try:
        with open(str(path), encoding="utf-8") as handle:
            return require(raw, "RawPyTorchMergeConfig").model_validate(yaml.safe_load(handle))
    except Exception:  # noqa: BLE001 - mergekit's own code reads it again and says what is wrong
        return None
