"""Everything that touches mergekit's private parts, in one place.

- the registry's table (to replace mergekit's built-in ``ram``, which has no public API);
- ``MergePlanner.plan_to_disk`` / ``plan_in_memory`` (recipe check, pre-pass, statistics);
- ``mergekit.merge.run_merge`` (the model card section);
- ``mergekit.scripts.merge_raw_pytorch.plan_flat_merge`` (``mergekit-pytorch``);
- the click commands of ``mergekit-yaml``, ``mergekit-multi`` and ``mergekit-pytorch``
  (one-line errors, the CUDA check, the statistics table).

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
from contextvars import ContextVar
from types import ModuleType
from typing import Any, Callable, Iterator, Optional

from pydantic import BaseModel

from mergekit_ram.errors import RamError
from mergekit_ram.parameters import ParameterError, check_parameter, parameter_info

LOG = logging.getLogger(__name__)

TESTED_MERGEKIT = ("0.1.5",)
RAM_METHODS = ("ram", "ram_plus")
_MARK = "__mergekit_ram_wrapped__"


class MergekitMovedError(RamError, RuntimeError):
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
    import mergekit.scripts.multimerge
    import mergekit.scripts.run_yaml

    register_methods(mergekit.merge_methods)
    patch_planner(mergekit.plan)
    patch_run_merge(mergekit.merge)
    patch_raw_pytorch(mergekit.scripts.merge_raw_pytorch)
    for script in (mergekit.scripts.run_yaml, mergekit.scripts.multimerge, mergekit.scripts.merge_raw_pytorch):
        patch_script(script)


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


def _wrap(owner: Any, name: str, make: Callable[[Callable], Callable], mark: str = _MARK) -> None:
    """Replace ``owner.name`` by ``make(original)`` once; ``mark`` tells this patch's wrapper."""
    original = _require(owner, name)
    if getattr(original, mark, False):
        return
    wrapper = functools.wraps(original)(make(original))
    setattr(wrapper, mark, True)
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


#: The output folder of the run_merge call in progress; its planner leaves publishing to it.
_RUN_MERGE_OUT: ContextVar[Optional[str]] = ContextVar("mergekit_ram_run_merge_out", default=None)


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
            if not to_disk:
                return attach_ram_plan(targets, self.options, None)
            out_path = args[0] if args else kwargs["out_path"]
            publish_in_graph = _RUN_MERGE_OUT.get() != out_path
            return attach_ram_plan(targets, self.options, out_path, publish_in_graph=publish_in_graph)

        return planned

    _wrap(planner, "plan_to_disk", lambda original: make(original, True))
    _wrap(planner, "plan_in_memory", lambda original: make(original, False))


def patch_run_merge(merge: ModuleType) -> None:
    """Checks first; weights published only when the whole merge succeeded; card section."""
    from mergekit_ram import staging

    def make(original: Callable) -> Callable:
        def run_merge(merge_config: Any, out_path: str, options: Any, config_source: Optional[str] = None) -> Any:
            if not _is_ours(merge_config.merge_method):
                return original(merge_config, out_path, options=options, config_source=config_source)
            check_config(merge_config.merge_method, merge_config)
            created = staging.begin(out_path)
            token = _RUN_MERGE_OUT.set(out_path)
            try:
                result = original(merge_config, out_path, options=options, config_source=config_source)
                staging.publish(out_path)
            except BaseException:
                staging.abandon(out_path, created)
                raise
            finally:
                _RUN_MERGE_OUT.reset(token)
            if options.write_model_card:
                append_card_section(out_path)
            report_summary(out_path, options)  # mergekit-ram CLI work (issue 13)
            return result

        return run_merge

    _wrap(merge, "run_merge", make)
    patched = merge.run_merge
    for name in ("mergekit.scripts.run_yaml", "mergekit.scripts.multimerge"):
        module = sys.modules.get(name)
        if module is not None and getattr(module, "run_merge", None) is not patched:
            module.run_merge = patched


#: The staged output of the mergekit-pytorch run in progress: (out_path, created).
_RAW_OUT: ContextVar[Optional[tuple[str, bool]]] = ContextVar("mergekit_ram_raw_out", default=None)


def patch_raw_pytorch(raw: ModuleType) -> None:
    """``mergekit-pytorch`` plans its own flat merge: give it the same checks and pre-pass.

    Its weights are published by the graph's last task; its command is wrapped so that a
    failure during the merge removes what was staged.
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
            targets = attach_ram_plan(targets, options, out_path, publish_in_graph=True)
            _RAW_OUT.set((out_path, staging.begin(out_path)))
            return targets

        return plan_flat_merge

    def make_command(original: Callable) -> Callable:
        def command(*args: Any, **kwargs: Any) -> Any:
            token = _RAW_OUT.set(None)
            try:
                return original(*args, **kwargs)
            except BaseException:
                staged = _RAW_OUT.get()
                if staged is not None:
                    staging.abandon(*staged)
                raise
            finally:
                _RAW_OUT.reset(token)

        return command

    _wrap(raw, "plan_flat_merge", make_plan)
    _wrap(_require(raw, "main"), "callback", make_command)


# Console scripts ------------------------------------------------------------------

#: mergekit's console scripts: module -> (command name, the argument that names the recipe file)
SCRIPTS = {
    "mergekit.scripts.run_yaml": ("mergekit-yaml", "config_file"),
    "mergekit.scripts.multimerge": ("mergekit-multi", "config_file"),
    "mergekit.scripts.merge_raw_pytorch": ("mergekit-pytorch", "config_path"),
}
_CLI_MARK = "__mergekit_ram_cli__"


def patch_script(script: ModuleType) -> None:
    """The plugin's errors as one line (``Error: ...``, exit 1; the traceback with ``-v``).

    The plugin's own errors are told by type (``RamError``). A YAML or schema error and a
    missing CUDA device are reported so only for a file that asks for ``ram``/``ram_plus``:
    for every other recipe mergekit's output stays as it was. ``mergekit-pytorch`` (which
    has no ``run_merge``) also shows the statistics table here.
    """
    name, recipe_argument = SCRIPTS[script.__name__]

    def make(original: Callable) -> Callable:
        def callback(*args: Any, **kwargs: Any) -> Any:
            try:
                options = check_script_recipe(script, name, kwargs.get(recipe_argument), kwargs)
                result = original(*args, **kwargs)
            except RamError as error:
                from mergekit_ram.errors import exit_on_one_line

                exit_on_one_line(error, verbose=bool(kwargs.get("verbosity")))
            if options is not None and name == "mergekit-pytorch":
                report_summary(kwargs["out_path"], options)
            return result

        return callback

    _wrap(_require(script, "main"), "callback", make, mark=_CLI_MARK)


def check_script_recipe(script: ModuleType, name: str, path: Optional[str], arguments: dict[str, Any]) -> Any:
    """For a recipe file that asks for a RAM method: read and validate it as ``name`` will,
    check the device, and return the command's MergeOptions; None for any other file."""
    from mergekit.config import MergeConfiguration
    from mergekit.options import MergeOptions

    from mergekit_ram.recipe_file import names_ram_method, read_single_document, read_stages, read_text, validate

    text = read_text(path) if path else None
    if text is None or not names_ram_method(text):
        return None
    if name == "mergekit-multi":
        configs = [stage.config for stage in read_stages(path, text, arguments.get("intermediate_dir") or "")]
    else:
        schema = _require(script, "RawPyTorchMergeConfig") if name == "mergekit-pytorch" else MergeConfiguration
        configs = [validate(path, read_single_document(path, text, name), schema)]
    if not any(_is_ours(config.merge_method) for config in configs):
        return None
    options = MergeOptions(**{key: value for key, value in arguments.items() if key in MergeOptions.model_fields})
    check_device(options)
    return options


def check_device(options: Any) -> None:
    """A CUDA device was asked for (``--cuda``, ``--gpu-rich``, ``--device cuda...``): it exists."""
    device = str(options.device or "cpu")
    if not device.startswith("cuda"):
        return
    import torch

    from mergekit_ram.errors import DeviceError

    index = int(device.partition(":")[2] or 0)
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if index < count:
        return
    flag = "--gpu-rich" if options.gpu_rich else "--cuda" if options.cuda else f"--device {device}"
    build = "CPU build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
    if count == 0:
        raise DeviceError(f"{flag} was given but no CUDA device is available (torch {torch.__version__}, {build})")
    raise DeviceError(f"{flag} was given but only {count} CUDA device(s) are visible (cuda:0 to cuda:{count - 1})")


def read_statistics(out_path: str) -> Optional[Any]:
    """The RamStatistics a merge wrote into ``out_path``, or None if it wrote none."""
    from mergekit_ram.stats import STATISTICS_FILE, RamStatistics

    path = os.path.join(out_path, STATISTICS_FILE)
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as handle:
        return RamStatistics.from_dict(json.load(handle))


def report_summary(out_path: str, options: Any) -> None:
    """After a RAM merge: model, density, rho and lambda on stderr, next to mergekit's own
    progress output and, like it, not with ``--quiet``."""
    if getattr(options, "quiet", False):
        return
    statistics = read_statistics(out_path)
    if statistics is None:
        return
    import click

    from mergekit_ram.stats import STATISTICS_FILE

    settings = ", ".join(f"{key} = {value}" for key, value in statistics.parameters.items())
    click.echo(
        f"{statistics.method} merge written to {out_path} ({settings}); "
        f"per-tensor counts in {STATISTICS_FILE}\n{statistics.compact_table()}",
        err=True,
    )


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
    card = os.path.join(out_path, "README.md")
    statistics = read_statistics(out_path) if os.path.exists(card) else None
    if statistics is None:
        return
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
