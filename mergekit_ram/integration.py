"""Everything that touches mergekit's private parts, in one place.

- the registry's table (to replace mergekit's built-in ``ram``, which has no public API);
- ``MergePlanner.plan_to_disk`` / ``plan_in_memory`` (recipe check, pre-pass, statistics);
- ``mergekit.merge.run_merge`` (the output transaction of ``staging``, the model card section);
- ``mergekit.scripts.merge_raw_pytorch.plan_flat_merge`` and its command (``mergekit-pytorch``);
- the click commands of ``mergekit-yaml``, ``mergekit-multi`` and ``mergekit-pytorch``
  (one-line errors, the CUDA check, the statistics table).

Each patch is idempotent and checks that the internals it relies on are still there,
failing with the mergekit version in the message if they moved.
"""

from __future__ import annotations

import difflib
import functools
import importlib.metadata
import json
import logging
import os
import sys
import types
import warnings
from types import ModuleType
from typing import Any, Callable, Iterator, NamedTuple, Optional, Union, get_args, get_origin

import yaml
from pydantic import BaseModel

from mergekit_ram.errors import RamError
from mergekit_ram.parameters import (
    ParameterError,
    RecipeError,
    check_lambda_range,
    check_parameter,
    close_name,
    declared_names,
    parameter_info,
    unknown_parameter,
)

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
    patch_multimerge(mergekit.scripts.multimerge)
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


#: Set to 1 to keep mergekit's own ``ram`` (``ram_plus`` stays mergekit-ram's); read at registration.
BUILTIN_RAM_VARIABLE = "MERGEKIT_RAM_BUILTIN_RAM"


def keep_builtin_ram() -> bool:
    return os.environ.get(BUILTIN_RAM_VARIABLE, "").strip().lower() in ("1", "true", "yes", "on")


def register_methods(merge_methods: ModuleType) -> None:
    """Add ``ram_plus``; replace the built-in ``ram`` (and only that one) with ours.

    With ``MERGEKIT_RAM_BUILTIN_RAM=1`` mergekit's built-in ``ram`` stays (or is put back).
    """
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
    builtin = getattr(builtin_ram, "ram_merge", None)
    for name, method in METHODS.items():
        current = table.get(name)
        if name == "ram" and keep_builtin_ram() and builtin is not None and current in (method, builtin):
            table[name] = builtin
            LOG.warning(
                "mergekit-ram: %s=1: keeping mergekit's built-in 'ram' (arithmetic in the checkpoint dtype, "
                "no ram_statistics.json); 'ram_plus' is mergekit-ram's",
                BUILTIN_RAM_VARIABLE,
            )
        elif current is method:
            continue
        elif current is None:
            registry.register(method)
        elif name == "ram" and current is builtin:
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


def check_config(method: str, config: Any, source: Optional[str] = None) -> None:
    """Keys (when the recipe's YAML ``source`` is at hand), parameters, base model and model
    paths of a RAM recipe, before anything is read."""
    from mergekit_ram.checks import check_models

    if source is not None:
        check_recipe_keys(method, yaml.safe_load(source), type(config))
    check_recipe(method, config)
    check_models(config)


def patch_planner(plan: ModuleType) -> None:
    """Check RAM recipes before planning; run the pre-pass and add statistics after."""
    from mergekit_ram import staging
    from mergekit_ram.prepass import attach_ram_plan

    planner = _require(plan, "MergePlanner")

    def make(original: Callable, to_disk: bool) -> Callable:
        def planned(self: Any, *args: Any, **kwargs: Any) -> Any:
            method = self.config.merge_method
            if not _is_ours(method):
                return original(self, *args, **kwargs)
            out_path = (args[0] if args else kwargs["out_path"]) if to_disk else None
            if out_path is None or not staging.is_staging_folder(out_path):  # else run_merge checked it already
                check_config(method, self.config)
            targets = original(self, *args, **kwargs)
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
            check_config(merge_config.merge_method, merge_config, config_source)
            with staging.output_transaction(out_path) as staged:
                result = original(merge_config, staged, options=options, config_source=config_source)
                if not os.path.isdir(staged):
                    raise MergekitMovedError(
                        f"mergekit moved its output out of {staged} (an architecture with post_fill_parameters); "
                        "mergekit-ram cannot publish it"
                    )
                if options.write_model_card:
                    append_card_section(staged)
            report_summary(out_path, options)
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
            check_recipe_file(kwargs.get("config_path"), _require(raw, "RawPyTorchMergeConfig"))
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
    from mergekit_ram.stats import STATISTICS_FILE, statistics_from_dict

    path = os.path.join(out_path, STATISTICS_FILE)
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as handle:
        return statistics_from_dict(json.load(handle))


def report_summary(out_path: str, options: Any) -> None:
    """After a RAM merge: model, density, rho and lambda on stderr, next to mergekit's own
    progress output and, like it, not with ``--quiet``."""
    if getattr(options, "quiet", False):
        return
    statistics = read_statistics(out_path)
    if statistics is None:
        return
    import click

    from mergekit_ram.stats import STATISTICS_FILE, compact_table

    settings = ", ".join(f"{key} = {value}" for key, value in statistics.parameters.items())
    click.echo(
        f"{statistics.method} merge written to {out_path} ({settings}); "
        f"per-tensor counts in {STATISTICS_FILE}\n{compact_table(statistics)}",
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


def patch_multimerge(multimerge: ModuleType) -> None:
    """``mergekit-multi`` validates each stage of its file and rebuilds it without the keys it
    dropped; check the raw stages of RAM recipes for unknown keys first."""

    def make(original: Callable) -> Callable:
        def load_config(config_source: str, intermediate_dir: str) -> Any:
            for document in yaml.safe_load_all(config_source):
                if isinstance(document, dict):
                    stage = {key: value for key, value in document.items() if key != "name"}
                    _check_raw_keys(stage, _require(multimerge, "MergeConfiguration"))
            return original(config_source, intermediate_dir)

        return load_config

    _wrap(multimerge, "load_config", make)


def append_card_section(out_path: str) -> None:
    """Tag the card ``mergekit-ram`` and add how to reproduce the merge and its statistics."""
    card = os.path.join(out_path, "README.md")
    statistics = read_statistics(out_path) if os.path.exists(card) else None
    if statistics is None:
        return
    from mergekit_ram.stats import card_markdown

    with open(card, encoding="utf-8") as handle:
        text = handle.read()
    with open(card, "w", encoding="utf-8") as handle:
        handle.write(with_card_tag(text, CARD_TAG) + "\n" + card_markdown(statistics))


#: The Hub tag of every model merged with mergekit-ram's methods.
CARD_TAG = "mergekit-ram"


def with_card_tag(card: str, tag: str) -> str:
    """``card`` with ``tag`` appended to the ``tags`` of its YAML front matter (as mergekit dumps it)."""
    if not card.startswith("---\n"):
        return card
    end = card.find("\n---\n", 4)
    if end < 0:
        return card
    metadata = yaml.safe_load(card[4:end]) or {}
    if not isinstance(metadata, dict):
        return card
    tags = list(metadata.get("tags") or [])
    if tag in tags:
        return card
    metadata["tags"] = [*tags, tag]
    return "---\n" + yaml.dump(metadata) + card[end + 1 :]


# Recipe checks ------------------------------------------------------------------


class RecipeSetting(NamedTuple):
    """One parameter set in a recipe: where (``models[1].parameters``), name, setting, and whether
    the block is a model's own (``models[i]``, ``slices[j].sources[i]``)."""

    where: str
    name: str
    value: Any
    per_model: bool


def check_recipe(method: str, config: BaseModel) -> None:
    """Every parameter of a RAM recipe: known, in a block where it applies, with a valid value.

    mergekit silently drops parameters a method does not declare. A name another registered
    method declares (``weight``, ``density``, ...) is ignored with a warning, as mergekit's
    built-in ``ram`` ignored it; a near miss of one of ours (``apha``) or a name no method
    declares is an error. Shared settings (``epsilon``, ``r``, ``alpha``, ``rule``) set in a
    model's block would be ignored by mergekit, so they are refused there.
    """
    others = _declared_by_other_methods(method)
    ignored: dict[str, list[str]] = {}
    values: dict[str, list[tuple[Any, str]]] = {}
    for setting in _parameter_settings(config):
        if setting.name not in declared_names(method):
            if setting.name in others and close_name(method, setting.name) is None:
                ignored.setdefault(setting.name, []).append(setting.where)
                continue
            raise unknown_parameter(method, setting.name, setting.where)
        info = parameter_info(method, setting.name, setting.where)
        if setting.per_model and not info.per_model:
            raise ParameterError(
                f"{method}: parameter {setting.name!r} in {setting.where} is set for one model, but "
                f"{setting.name} applies to the whole merge and mergekit would ignore it there: move it to "
                f"the top-level `parameters:`{_SHARED_SCOPE.get(setting.name, '')}"
            )
        for scalar in _scalars(setting.value):
            values.setdefault(setting.name, []).append(
                (check_parameter(method, setting.name, scalar, setting.where), setting.where)
            )
    for name, places in ignored.items():
        hint = "; set merge_method: ram_plus to use it" if name in declared_names("ram_plus") else ""
        LOG.warning(
            "%s ignores parameter %r (in %s): it is a parameter of %s, not of %s%s",
            method,
            name,
            ", ".join(places),
            _listing(others[name]),
            method,
            hint,
        )
    if method == "ram_plus":
        r, where = max(values.get("r", [(parameter_info(method, "r").default, "the defaults")]))
        alphas = [value for value, _ in values.get("alpha", [(parameter_info(method, "alpha").default, "")])]
        rules = [value for value, _ in values.get("rule", [(parameter_info(method, "rule").default, "")])]
        check_lambda_range(method, r, alphas, rules, where)


_SHARED_SCOPE = {
    "epsilon": " (epsilon may vary per tensor with `filter`, or per slice in `slices[i].parameters`, "
    "but not per model)",
    "r": " (lambda_t = 1 + r * clip(rho_t, 0, alpha) is global: one r, one alpha, one rule per merge)",
    "alpha": " (lambda_t = 1 + r * clip(rho_t, 0, alpha) is global: one r, one alpha, one rule per merge)",
    "rule": " (lambda_t = 1 + r * clip(rho_t, 0, alpha) is global: one r, one alpha, one rule per merge)",
}


def _declared_by_other_methods(method: str) -> dict[str, list[str]]:
    """Parameter name -> the other registered mergekit methods that declare it, asked of the registry now."""
    from mergekit.merge_methods import registry

    declared: dict[str, list[str]] = {}
    for other in _require(registry, "registered_methods")():
        spec = getattr(other, "spec", None)
        if spec is None or spec.name == method:
            continue
        for parameter in spec.parameters:
            declared.setdefault(parameter.name, []).append(spec.name)
    return declared


def _listing(names: list[str], shown: int = 4) -> str:
    names = sorted(set(names))
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


def _parameter_settings(node: Any, where: str = "") -> Iterator[RecipeSetting]:
    """Every ``parameters`` entry of a recipe, depth first, with its location."""
    if isinstance(node, BaseModel):
        fields = type(node).model_fields
        per_model = "model" in fields  # models[i], slices[j].sources[i]: one model's block
        for field_name in fields:
            value = getattr(node, field_name)
            location = f"{where}.{field_name}" if where else field_name
            if field_name == "parameters" and isinstance(value, dict):
                for name, setting in value.items():
                    yield RecipeSetting(location, name, setting, per_model)
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


def check_recipe_file(path: Optional[str], schema: type[BaseModel]) -> None:
    """Unknown keys in the recipe file at ``path`` (a RAM one), before mergekit drops them."""
    if path is None or not os.path.isfile(path):
        return
    with open(path, encoding="utf-8") as handle:
        _check_raw_keys(yaml.safe_load(handle), schema)


def _check_raw_keys(raw: Any, schema: type[BaseModel]) -> None:
    method = raw.get("merge_method") if isinstance(raw, dict) else None
    if isinstance(method, str) and _is_ours(method):
        check_recipe_keys(method, raw, schema)


def check_recipe_keys(method: str, raw: Any, schema: type[BaseModel]) -> None:
    """Refuse keys mergekit's recipe classes do not have (``paramaters:``, a top-level ``rule:``).

    pydantic drops unknown keys silently, so such a setting would merge with the defaults.
    """
    for where, key, valid in _unknown_keys(raw, schema, ""):
        place = f"in `{where}`" if where else "at the top level of the recipe"
        if key in declared_names(method) and "parameters" in valid:
            per_model = parameter_info(method, key).per_model and where
            target = f"`{where}.parameters:`" if per_model else "the top-level `parameters:`"
            fix = f": {key!r} is a parameter of {method}; set it under {target}"
        else:
            hint = close_key(key, valid)
            fix = f" (did you mean {hint!r}?)" if hint else ""
        raise RecipeError(
            f"{method} recipe: unknown key {key!r} {place}, which mergekit would ignore{fix}; "
            f"valid keys there: {', '.join(valid)}"
        )


def close_key(key: str, valid: tuple[str, ...]) -> Optional[str]:
    hint = difflib.get_close_matches(key, valid, n=1)
    return hint[0] if hint else None


#: Recipe classes whose keys are checked; others (model references, tokenizer settings) are leaves.
_RECIPE_MODULES = ("mergekit.config", "mergekit.scripts.merge_raw_pytorch")


def _unknown_keys(raw: Any, annotation: Any, where: str) -> Iterator[tuple[str, str, tuple[str, ...]]]:
    """(where, key, valid keys) for each key of ``raw`` that its recipe class does not have."""
    if isinstance(raw, dict):
        classes = _recipe_classes(annotation)
        if len(classes) == 1:
            fields = classes[0].model_fields
            for key, value in raw.items():
                if key not in fields:
                    yield where, str(key), tuple(fields)
                else:
                    yield from _unknown_keys(value, fields[key].annotation, f"{where}.{key}" if where else str(key))
            return
        members = _members(annotation, dict)
        if len(members) == 1:
            for key, value in raw.items():
                yield from _unknown_keys(value, members[0], f"{where}.{key}" if where else str(key))
    elif isinstance(raw, list):
        members = _members(annotation, list)
        if members:
            item = members[0] if len(members) == 1 else Union[tuple(members)]
            for index, value in enumerate(raw):
                yield from _unknown_keys(value, item, f"{where}[{index}]")


def _alternatives(annotation: Any) -> tuple[Any, ...]:
    """The arms of a Union / Optional, or the annotation itself."""
    if get_origin(annotation) in (Union, types.UnionType):
        return tuple(arm for arg in get_args(annotation) for arm in _alternatives(arg))
    return (annotation,)


def _recipe_classes(annotation: Any) -> list[type[BaseModel]]:
    return [
        arm
        for arm in _alternatives(annotation)
        if isinstance(arm, type) and issubclass(arm, BaseModel) and arm.__module__ in _RECIPE_MODULES
    ]


def _members(annotation: Any, container: type) -> list[Any]:
    """The item types of the ``list`` arms, or the value types of the ``dict`` arms, of an annotation."""
    found = []
    for arm in _alternatives(annotation):
        if get_origin(arm) is container and get_args(arm) and get_args(arm)[-1] not in found:
            found.append(get_args(arm)[-1])
    return found


__all__ = ["ParameterError", "RecipeError", "register", "check_recipe"]
