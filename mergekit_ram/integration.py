"""Everything that touches mergekit's private parts, in one place.

- the registry's table (to replace mergekit's built-in ``ram``, which has no public API);
- ``MergePlanner.plan_to_disk`` / ``plan_in_memory`` (recipe check, pre-pass, statistics);
- ``mergekit.merge.run_merge`` (the output transaction of ``staging``, the model card section);
- ``mergekit.scripts.merge_raw_pytorch.plan_flat_merge`` and its command (``mergekit-pytorch``).

Each patch is idempotent and checks that the internals it relies on are still there,
failing with the mergekit version in the message if they moved.
"""

from __future__ import annotations

import functools
import importlib.metadata
import json
import logging
import os
import sys
import warnings
from types import ModuleType
from typing import Any, Callable, Iterator, Optional

from pydantic import BaseModel

from mergekit_ram.parameters import ParameterError, check_parameter, parameter_info

LOG = logging.getLogger(__name__)

TESTED_MERGEKIT = ("0.1.5",)
RAM_METHODS = ("ram", "ram_plus")
_MARK = "__mergekit_ram_wrapped__"


class MergekitMovedError(RuntimeError):
    """A mergekit internal this plugin relies on is not where mergekit 0.1.5 had it."""


def mergekit_version() -> str:
    try:
        return importlib.metadata.version("mergekit")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def register() -> None:
    """Register ``ram`` and ``ram_plus`` with mergekit and hook its planner; idempotent."""
    import mergekit.merge
    import mergekit.merge_methods
    import mergekit.plan
    import mergekit.scripts.merge_raw_pytorch

    register_methods(mergekit.merge_methods)
    patch_planner(mergekit.plan)
    patch_run_merge(mergekit.merge)
    patch_raw_pytorch(mergekit.scripts.merge_raw_pytorch)


def _require(owner: Any, name: str) -> Any:
    """``owner.name``, or an error naming the mergekit version if it moved."""
    if not hasattr(owner, name):
        where = getattr(owner, "__name__", type(owner).__name__)
        raise MergekitMovedError(
            f"mergekit-ram cannot find {where}.{name} in mergekit {mergekit_version()}; "
            f"it supports mergekit {', '.join(TESTED_MERGEKIT)}"
        )
    return getattr(owner, name)


def register_methods(merge_methods: ModuleType) -> None:
    """Add ``ram_plus``; replace the built-in ``ram`` (and only that one) with ours."""
    version = mergekit_version()
    if version not in TESTED_MERGEKIT:
        warnings.warn(
            f"mergekit-ram is tested with mergekit {', '.join(TESTED_MERGEKIT)}; found {version}. "
            "Its internals may have moved.",
            stacklevel=2,
        )
    from mergekit.merge_methods import ram as builtin_ram
    from mergekit.merge_methods import registry

    from mergekit_ram.methods import METHODS

    table = _require(registry, "_METHODS")
    for name, method in METHODS.items():
        current = table.get(name)
        if current is method:
            continue
        if current is None:
            registry.register(method)
        elif name == "ram" and current is getattr(builtin_ram, "ram_merge", None):
            table[name] = method
            LOG.info("mergekit-ram: replaced mergekit's built-in 'ram' (checkpoint-dtype arithmetic) with float32 RAM")
        else:
            LOG.warning("mergekit-ram: merge method %r is already registered by someone else; leaving it", name)


def _wrap(owner: Any, name: str, make: Callable[[Callable], Callable]) -> None:
    original = _require(owner, name)
    if getattr(original, _MARK, False):
        return
    wrapper = functools.wraps(original)(make(original))
    setattr(wrapper, _MARK, True)
    setattr(owner, name, wrapper)


def _is_ours(method_name: str) -> bool:
    from mergekit import merge_methods

    from mergekit_ram.methods import METHODS

    if method_name not in METHODS:
        return False
    try:
        return merge_methods.get(method_name) is METHODS[method_name]
    except RuntimeError:
        return False


def check_config(method: str, config: Any) -> None:
    """Parameters, base model and model paths of a RAM recipe, before anything is read."""
    from mergekit_ram.checks import check_models

    check_recipe(method, config)
    check_models(config)


def patch_planner(plan: ModuleType) -> None:
    """Check RAM recipes before planning; run the pre-pass and add statistics after."""
    from mergekit_ram.prepass import attach_ram_plan

    planner = _require(plan, "MergePlanner")

    def make(original: Callable, to_disk: bool) -> Callable:
        def planned(self: Any, *args: Any, **kwargs: Any) -> Any:
            method = self.config.merge_method
            if not _is_ours(method):
                return original(self, *args, **kwargs)
            check_config(method, self.config)
            targets = original(self, *args, **kwargs)
            out_path = (args[0] if args else kwargs["out_path"]) if to_disk else None
            return attach_ram_plan(targets, self.options, out_path)

        return planned

    _wrap(planner, "plan_to_disk", lambda original: make(original, True))
    _wrap(planner, "plan_in_memory", lambda original: make(original, False))


def patch_run_merge(merge: ModuleType) -> None:
    """RAM merges: inputs' folders refused, checks first, everything staged and published at once.

    mergekit's own ``run_merge`` writes into the staging folder of an output transaction
    (``staging.output_transaction``): weights, config, tokenizer, card and statistics reach
    ``out_path`` together, or not at all. Other methods run exactly as mergekit has them.
    """
    from mergekit_ram import staging

    def make(original: Callable) -> Callable:
        def run_merge(merge_config: Any, out_path: str, options: Any, config_source: Optional[str] = None) -> Any:
            if not _is_ours(merge_config.merge_method):
                return original(merge_config, out_path, options=options, config_source=config_source)
            staging.refuse_input_folder(out_path, _model_folders(merge_config))
            check_config(merge_config.merge_method, merge_config)
            with staging.output_transaction(out_path) as staged:
                result = original(merge_config, staged, options=options, config_source=config_source)
                if not os.path.isdir(staged):
                    raise RuntimeError(
                        f"mergekit moved its output out of {staged} (an architecture with post_fill_parameters); "
                        "mergekit-ram cannot publish it"
                    )
                if options.write_model_card:
                    append_card_section(staged)
            return result

        return run_merge

    _wrap(merge, "run_merge", make)
    patched = merge.run_merge
    for name in ("mergekit.scripts.run_yaml", "mergekit.scripts.multimerge"):
        module = sys.modules.get(name)
        if module is not None and getattr(module, "run_merge", None) is not patched:
            module.run_merge = patched


def _model_folders(merge_config: Any) -> Iterator[tuple[str, str]]:
    """(model as the recipe names it, local folder) for every model and LoRA the recipe reads."""
    for model in merge_config.referenced_models():
        for reference in (model.model, model.lora):
            if reference is not None:
                yield str(model), os.path.expanduser(reference.path)


def patch_raw_pytorch(raw: ModuleType) -> None:
    """``mergekit-pytorch`` plans its own flat merge: the same checks, pre-pass and transaction.

    Its command is wrapped: a RAM recipe (read once more here, a few bytes) runs inside an
    output transaction whose staging folder is the ``out_path`` mergekit sees.
    """
    from mergekit_ram import staging
    from mergekit_ram.prepass import attach_ram_plan

    def make_plan(original: Callable) -> Callable:
        def plan_flat_merge(
            config: Any, out_path: str, tensor_union: bool, tensor_intersection: bool, options: Any
        ) -> Any:
            if not _is_ours(config.merge_method):
                return original(config, out_path, tensor_union, tensor_intersection, options)
            check_config(config.merge_method, config)
            targets = original(config, out_path, tensor_union, tensor_intersection, options)
            return attach_ram_plan(targets, options, out_path)

        return plan_flat_merge

    def make_command(original: Callable) -> Callable:
        def command(*args: Any, **kwargs: Any) -> Any:
            config = _raw_config(raw, kwargs.get("config_path"))
            if args or config is None or "out_path" not in kwargs or not _is_ours(config.merge_method):
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

    _wrap(raw, "plan_flat_merge", make_plan)
    _wrap(_require(raw, "main"), "callback", make_command)


def _raw_config(raw: ModuleType, path: Optional[str]) -> Any:
    """The ``mergekit-pytorch`` recipe at ``path``, or None (mergekit then reports the problem)."""
    import yaml

    try:
        with open(str(path), encoding="utf-8") as handle:
            return _require(raw, "RawPyTorchMergeConfig").model_validate(yaml.safe_load(handle))
    except Exception:  # noqa: BLE001 - mergekit's own code reads it again and says what is wrong
        return None


def plan_merge_tasks(config: Any, options: Any) -> list[Any]:
    """Plan a recipe exactly as ``run_merge`` would, without running it: its merge tasks."""
    import mergekit.merge
    from mergekit.architecture import get_architecture_info
    from mergekit.io.tasks import LoaderCache
    from mergekit.plan import MergePlanner

    register()
    check_config(config.merge_method, config)
    arch_info = get_architecture_info(config, options)
    loaders = LoaderCache()
    loaders.setup(options=options)
    for model in config.referenced_models():
        loaders.get(model)
    out_config = _require(mergekit.merge, "_model_out_config")(
        config, arch_info, trust_remote_code=options.trust_remote_code
    )
    planner = MergePlanner(config, arch_info, options=options, out_model_config=out_config)
    # plan_in_memory would do, but mergekit 0.1.5's ReturnTensor refuses its own merge tasks.
    _require(planner, "_plan")()
    return [task for _, task in _require(planner, "_tensors")]


def append_card_section(out_path: str) -> None:
    from mergekit_ram.stats import STATISTICS_FILE, RamStatistics

    card = os.path.join(out_path, "README.md")
    statistics_path = os.path.join(out_path, STATISTICS_FILE)
    if not (os.path.exists(card) and os.path.exists(statistics_path)):
        return
    with open(statistics_path, encoding="utf-8") as handle:
        statistics = RamStatistics.from_dict(json.load(handle))
    with open(card, "a", encoding="utf-8") as handle:
        handle.write("\n" + statistics.markdown())


# Recipe checks ------------------------------------------------------------------


def check_recipe(method: str, config: BaseModel) -> None:
    """Refuse unknown names and invalid values in every ``parameters`` block of a recipe.

    mergekit silently drops parameters a method does not declare; for RAM a typo such
    as ``apha`` would quietly merge with the default, so it is an error here.
    """
    for where, name, value in _parameter_settings(config):
        parameter_info(method, name, where)
        for scalar in _scalars(value):
            check_parameter(method, name, scalar, where)


def _parameter_settings(node: Any, where: str = "") -> Iterator[tuple[str, str, Any]]:
    if isinstance(node, BaseModel):
        for field_name in type(node).model_fields:
            value = getattr(node, field_name)
            location = f"{where}.{field_name}" if where else field_name
            if field_name == "parameters" and isinstance(value, dict):
                for name, setting in value.items():
                    yield location, name, setting
            elif field_name != "parameters":
                yield from _parameter_settings(value, location)
    elif isinstance(node, (list, tuple)):
        for index, item in enumerate(node):
            yield from _parameter_settings(item, f"{where}[{index}]")
    elif isinstance(node, dict):
        for key, item in node.items():
            yield from _parameter_settings(item, f"{where}.{key}")


def _scalars(setting: Any) -> Iterator[Any]:
    """The scalar values inside a setting: plain, gradient list, or filtered values."""
    if isinstance(setting, list):
        for item in setting:
            yield from _scalars(item)
    elif isinstance(setting, BaseModel) and hasattr(setting, "value"):
        yield from _scalars(setting.value)
    else:
        yield setting


__all__ = ["ParameterError", "register", "check_recipe"]
