"""Recipe checks of RAM recipes, over mergekit's recipe classes: parameters, keys, models.

mergekit's pydantic recipe classes drop what they do not know, so a misspelled key or a
parameter in the wrong block would merge with the defaults; these checks refuse them, before
anything is read. Also here: reading mergekit-multi's stages, and the recipe's models as
plain ``ModelIdentity`` values for ``mergekit_ram.checks``.
"""

from __future__ import annotations

import logging
import os
import types
from typing import Any, Iterator, NamedTuple, Optional, Union, get_args, get_origin

import yaml
from pydantic import BaseModel

from mergekit_ram.checks import BaseFit, HeaderCache, check_models, close_method
from mergekit_ram.errors import RecipeError
from mergekit_ram.integration.internals import internal
from mergekit_ram.integration.registry import declared_by_other_methods, is_ours
from mergekit_ram.parameters import (
    METHOD_PARAMETERS,
    ParameterError,
    check_lambda_range,
    check_parameter,
    close_match,
    close_name,
    declared_names,
    parameter_info,
    unknown_parameter,
)
from mergekit_ram.planned import ModelIdentity
from mergekit_ram.recipe_file import Stage, read_documents, validate

LOG = logging.getLogger(__name__)
MergeConfiguration: Any = internal("mergekit.config", "MergeConfiguration")


def check_config(
    method: str, config: Any, headers: HeaderCache, source: Optional[str] = None, *, allow_crimes: Optional[bool] = None
) -> None:
    """Keys (when the recipe's YAML ``source`` is at hand), parameters, base model, model paths, and
    models that do not fit the base of a RAM recipe, before anything is read; ``headers`` keeps what it
    read for the tensor checks. ``allow_crimes`` is mergekit's option: architectures are compared only
    where it is False (None: the caller has no options, and mergekit compares them itself)."""
    if source is not None:
        check_recipe_keys(method, yaml.safe_load(source), type(config))
    check_recipe(method, config)
    base = getattr(config, "base_model", None)
    fit = BaseFit(
        same_architecture=same_architecture if allow_crimes is False else None,
        vocabulary_axes=vocabulary_axes,
        vocabulary_aligned=bool(getattr(config, "tokenizer_source", None) or getattr(config, "tokenizer", None)),
    )
    check_models(method, None if base is None else model_identity(base), list(model_lists(config)), headers, fit)


def _definitions(architecture: str) -> list[Any]:
    """mergekit's definitions of an ``architectures`` name (none: it infers one from the tensors)."""
    return list(internal("mergekit.architecture.json_definitions", "NAME_TO_ARCH").get(architecture, ()))


def same_architecture(name: str, other: str) -> bool:
    """Whether mergekit merges models of these two ``architectures`` without ``--allow-crimes``: one of its
    definitions for both, or a name it has none for (it then infers the architecture from the tensors)."""
    known, other_known = _definitions(name), _definitions(other)
    return name == other or not known or not other_known or any(one in other_known for one in known)


def vocabulary_axes(architecture: str) -> dict[str, int]:
    """The tensors mergekit's definition of ``architecture`` gives a vocabulary axis (embeddings, output
    head), by name and alias: the axis ``tokenizer_source`` aligns."""
    axes = {}
    for definition in _definitions(architecture):
        for module in definition.modules.values():
            layout = getattr(module.architecture, "definition", None)
            for weight in [*getattr(layout, "pre_weights", ()), *getattr(layout, "post_weights", ())]:
                if weight.vocabulary_axis is not None:
                    axes.update(dict.fromkeys([weight.name, *(weight.aliases or ())], weight.vocabulary_axis))
    return axes


def check_method_name(method: str) -> None:
    """A merge method mergekit does not know whose name misspells one of this plugin's: one line with the
    right name (mergekit's own error is a traceback, without it). Other unknown names stay mergekit's."""
    hint = close_method(method)
    if hint is None:
        return
    if method not in internal("mergekit.merge_methods.registry", "_METHODS"):
        raise RecipeError(f"unknown merge method {method!r} (did you mean {hint!r}?)")


def model_identity(model: Any) -> ModelIdentity:
    """A mergekit ``ModelReference`` (or a path string, as ``mergekit-pytorch`` has them) as plain data:
    the real path of a local model (``./ft``, ``ft/``, symlinks and ``~`` resolved) or the Hub id, with
    its revision, LoRA and architecture override."""
    if isinstance(model, str):
        return ModelIdentity(label=model, path=_real_path(model), local_paths=tuple(_local_paths([model])))
    lora = model.lora
    return ModelIdentity(
        label=str(model),
        path=_real_path(model.model.path),
        revision=model.model.revision,
        lora_path=_real_path(lora.path) if lora is not None else None,
        lora_revision=lora.revision if lora is not None else None,
        override_architecture=model.override_architecture,
        local_paths=tuple(_local_paths([model.model.path] + ([lora.path] if lora is not None else []))),
    )


def _real_path(path: str) -> str:
    """A local path as the file system resolves it (mergekit takes an existing path as local); else the id."""
    expanded = os.path.expanduser(path)
    return os.path.realpath(expanded) if os.path.exists(expanded) else path


def _local_paths(paths: list[str]) -> Iterator[str]:
    """Paths that must exist: absolute or explicitly relative ones (not Hub ids)."""
    for path in paths:
        if os.path.isabs(path) or path.startswith((".", "~")):
            yield os.path.expanduser(path)


def model_lists(config: Any) -> Iterator[tuple[str, list[ModelIdentity]]]:
    """Each list of a recipe's input models, with where it is: models, each slice's sources, modules."""
    if getattr(config, "models", None):
        yield "models", [model_identity(entry.model) for entry in config.models]
    for index, output_slice in enumerate(getattr(config, "slices", None) or []):
        yield f"slices[{index}].sources", [model_identity(source.model) for source in output_slice.sources]
    for name, module in (getattr(config, "modules", None) or {}).items():
        if module.models:
            yield f"modules.{name}.models", [model_identity(entry.model) for entry in module.models]
        for index, output_slice in enumerate(module.slices or []):
            yield (
                f"modules.{name}.slices[{index}].sources",
                [model_identity(source.model) for source in output_slice.sources],
            )


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
    others = declared_by_other_methods(method)
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
        users = [other for other in METHOD_PARAMETERS if name in declared_names(other)]
        hint = f"; set merge_method: {' or '.join(users)} to use it" if users else ""
        LOG.warning(
            "%s ignores parameter %r (in %s): it is a parameter of %s, not of %s%s",
            method,
            name,
            ", ".join(places),
            _listing(others[name]),
            method,
            hint,
        )
    if "r" in declared_names(method):
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
    "density": " (ram_ties trims every model's shared updates to one density)",
}


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
        check_raw_keys(yaml.safe_load(handle), schema)


def check_raw_keys(raw: Any, schema: type[BaseModel]) -> None:
    method = raw.get("merge_method") if isinstance(raw, dict) else None
    if isinstance(method, str) and is_ours(method):
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
            hint = close_match(key, valid)
            fix = f" (did you mean {hint!r}?)" if hint else ""
        raise RecipeError(
            f"{method} recipe: unknown key {key!r} {place}, which mergekit would ignore{fix}; "
            f"valid keys there: {', '.join(valid)}"
        )


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


def check_stage_keys(path: str, text: str) -> None:
    """Unknown keys of each RAM stage of a mergekit-multi file (mergekit-multi rebuilds a stage without them)."""
    for document in read_documents(path, text):
        if isinstance(document, dict):
            check_raw_keys({key: value for key, value in document.items() if key != "name"}, MergeConfiguration)


def read_stages(path: str, text: str, intermediate_dir: str = "") -> list[Stage]:
    """The stages of a recipe file as mergekit-multi reads them (a single recipe is one stage).

    A model named like another stage becomes ``intermediate_dir/<name>`` (mergekit's own
    ``patched_config``), and the stage records that it depends on that one.
    """
    patched_config = internal("mergekit.scripts.multimerge", "patched_config")

    stages: dict[Optional[str], Any] = {}
    for index, document in enumerate(read_documents(path, text)):
        where = f", document {index + 1}"
        if not isinstance(document, dict):
            raise RecipeError(f"{path}{where}: a recipe is a mapping of keys (merge_method, models, ...)")
        document = dict(document)
        name = document.pop("name", None)
        if name in stages:
            raise RecipeError(
                f"{path}{where}: "
                + (f"a second stage named {name!r}" if name is not None else "a second stage without a name")
                + "; each stage needs its own name (at most one may have none: the final merge)"
            )
        stages[name] = validate(path, document, MergeConfiguration, where)
    names = set(stages)
    result = []
    for name, config in stages.items():
        patched, used = patched_config(config, names, intermediate_dir)
        result.append(Stage(name=name, config=patched, depends_on=tuple(sorted(used))))
    return result
