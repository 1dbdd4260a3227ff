"""Checks of RAM recipes over mergekit's parsed recipe classes (keys given the recipe's text, parameters against
the registered methods' declarations, models as ``ModelIdentity``), and mergekit-multi's stages for the probe.

mergekit's pydantic classes drop what they do not know, so a misspelled key would merge with the defaults.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import yaml
from huggingface_hub.utils import HFValidationError, validate_repo_id
from mergekit.merge_methods import get, registered_methods
from pydantic import BaseModel, ValidationError

from mergekit_ram.checks import BaseFit, HeaderCache, check_models, close_method
from mergekit_ram.errors import RecipeError
from mergekit_ram.integration.internals import internal
from mergekit_ram.integration.registration import declared_by_other_methods
from mergekit_ram.parameters import (
    METHOD_NAMES,
    ParameterError,
    check_lambda_range,
    check_value,
    close_match,
)
from mergekit_ram.planned import ModelIdentity

LOG = logging.getLogger(__name__)
# The recipe's fields, its references' and the options' the checks read: checked once, at import.
internal("mergekit.config", "MergeConfiguration")
internal("mergekit.common", "ModelReference")
internal("mergekit.common", "ModelPath")
internal("mergekit.options", "MergeOptions")
#: Recipe classes whose keys are checked; others are leaves.
_RECIPE_MODULES = ("mergekit.config", "mergekit.scripts.merge_raw_pytorch")
_LAMBDA_SCOPE = " (lambda_t = 1 + r * clip(rho_t, 0, alpha) is global: one r, one alpha, one rule per merge)"
_SHARED_SCOPE = {
    "epsilon": " (epsilon may vary per tensor with `filter`, or per slice in `slices[i].parameters`, "
    "but not per model)",
    **dict.fromkeys(("r", "alpha", "rule"), _LAMBDA_SCOPE),
    "density": " (ram_ties trims every model's shared updates to one density)",
}


def check_config(config: Any, headers: HeaderCache, options: Any, source: Optional[str] = None) -> None:
    """Keys (given the YAML ``source``), parameters and models (with mergekit's ``options``: architectures only
    without ``--allow-crimes``, adapters only with ``--lora-merge-cache``)."""
    method = config.merge_method
    if source is not None:
        check_recipe_keys(method, yaml.safe_load(source), type(config))
    check_recipe(method, config)
    base = getattr(config, "base_model", None)
    fit = BaseFit(
        same_architecture=None if options.allow_crimes else same_architecture,
        vocabulary_axes=vocabulary_axes,
        vocabulary_aligned=bool(getattr(config, "tokenizer_source", None) or getattr(config, "tokenizer", None)),
    )
    lora_cache = bool(getattr(options, "lora_merge_cache", None))
    base_model = None if base is None else model_identity(base)
    check_models(method, base_model, list(model_lists(config)), headers, fit, lora_cache)
    if getattr(options, "write_model_card", False):
        check_card_paths(config)


def check_card_paths(config: Any) -> None:
    """A local folder written like a Hub id (``models/base``, ``base``): mergekit's card writer asks the Hub whether
    it is one (``mergekit.card.is_hf``: no ``/`` or ``~`` first, at most one ``/``), after the whole merge; offline
    that is a traceback, online a stranger's repository. ``./models/base`` is local to it, as to the merge."""
    for _, node in sorted(model_references(config), key=lambda found: found[0] != "base_model"):  # the base first
        for path in (node.model.path, *([node.lora.path] if node.lora is not None else [])):
            if path[:1] in "/~" or path.count("/") > 1 or not os.path.exists(path):
                continue
            with contextlib.suppress(HFValidationError):
                validate_repo_id(path)
                raise RecipeError(
                    f"model path {path} is a local folder written like a Hub id (org/name), which mergekit's model "
                    f"card would look up on the Hub once the merge is done: write it ./{path}"
                )


def _definitions(architecture: str) -> list[Any]:
    return list(internal("mergekit.architecture.json_definitions", "NAME_TO_ARCH").get(architecture, ()))


def same_architecture(name: str, other: str) -> bool:
    """Whether mergekit merges the two without ``--allow-crimes``."""
    known, other_known = _definitions(name), _definitions(other)
    return name == other or not known or not other_known or any(one in other_known for one in known)


def vocabulary_axes(architecture: str) -> dict[str, int]:
    """The vocabulary axis of each tensor that has one, by name and alias."""
    axes = {}
    for definition in _definitions(architecture):
        for module in definition.modules.values():
            layout = getattr(module.architecture, "definition", None)
            for weight in [*getattr(layout, "pre_weights", ()), *getattr(layout, "post_weights", ())]:
                if weight.vocabulary_axis is not None:
                    axes.update(dict.fromkeys([weight.name, *(weight.aliases or ())], weight.vocabulary_axis))
    return axes


def check_method_name(method: str) -> None:
    """A misspelling of one of this plugin's methods, with the right name (mergekit's error is a traceback)."""
    hint = close_method(method)
    if hint is not None and method not in {other.spec.name for other in registered_methods()}:
        raise RecipeError(f"unknown merge method {method!r} (did you mean {hint!r}?)")


def declared(method: str) -> dict[str, Any]:
    """The registered method's parameters by name (mergekit's ``ParameterSpec``: type with bounds, default)."""
    return {spec.name: spec for spec in get(method).spec.parameters}


def per_model(spec: Any) -> bool:
    return str(getattr(spec.scope, "value", spec.scope)) != "shared"


def whole_merge_defaults(method: str) -> dict[str, Any]:
    """The defaults of the parameters that are one value for the whole merge (r, alpha, rule, density)."""
    return {name: spec.default for name, spec in declared(method).items() if not per_model(spec) and name != "epsilon"}


def parameter_spec(method: str, name: str, where: str = "parameters") -> Any:
    """The declaration of ``name`` for ``method``, or a ParameterError listing the valid names (and a near miss)."""
    specs = declared(method)
    if name not in specs:
        hint = close_match(name, specs)
        suggestion = f" (did you mean {hint!r}?)" if hint else ""
        raise ParameterError(
            f"{method}: unknown parameter {name!r} in {where}{suggestion}; valid names: {', '.join(sorted(specs))}"
        )
    return specs[name]


def check_parameter(method: str, name: str, value: Any, where: str = "parameters") -> Any:
    """``value`` validated as the method declares ``name``, or one line naming it and where it was set."""
    return check_value(method, name, parameter_spec(method, name, where).value_type, value, where)


def model_identity(model: Any) -> ModelIdentity:
    """A ``ModelReference`` (or a ``mergekit-pytorch`` path) as plain data, local paths resolved."""
    if isinstance(model, str):
        return ModelIdentity(label=model, path=_real_path(model), local_paths=_local_paths(model))
    lora = model.lora
    return ModelIdentity(
        label=str(model),
        path=_real_path(model.model.path),
        revision=model.model.revision,
        lora_path=_real_path(lora.path) if lora is not None else None,
        lora_revision=lora.revision if lora is not None else None,
        override_architecture=model.override_architecture,
        local_paths=_local_paths(model.model.path, *([lora.path] if lora is not None else [])),
    )


def _real_path(path: str) -> str:
    """mergekit takes an existing path as local."""
    expanded = os.path.expanduser(path)
    return os.path.realpath(expanded) if os.path.exists(expanded) else path


def _local_paths(*paths: str) -> tuple[str, ...]:
    """Absolute or explicitly relative paths must exist (not Hub ids)."""
    return tuple(os.path.expanduser(path) for path in paths if os.path.isabs(path) or path.startswith((".", "~")))


def model_lists(config: Any) -> Iterator[tuple[str, list[ModelIdentity]]]:
    """Each list of a recipe's input models, with where it is (``models``, ``modules.m.slices[0].sources``)."""
    for where, node in recipe_nodes(config):
        for field in ("models", "sources"):
            if field in type(node).model_fields and getattr(node, field):
                yield _joined(where, field), [model_identity(entry.model) for entry in getattr(node, field)]


def model_references(config: Any) -> Iterator[tuple[str, Any]]:
    """Each model reference of a recipe (``ModelReference``: a model, its LoRA) with where it is."""
    for where, node in recipe_nodes(config):
        if {"model", "lora"} <= set(type(node).model_fields):
            yield where, node


def recipe_nodes(node: Any, where: str = "") -> Iterator[tuple[str, Any]]:
    """Each pydantic object in a recipe with where it is, children first, in mergekit's field order."""
    if isinstance(node, BaseModel):
        for name in type(node).model_fields:
            yield from recipe_nodes(getattr(node, name), _joined(where, name))
        yield where, node
    elif isinstance(node, (list, tuple)):
        for index, item in enumerate(node):
            yield from recipe_nodes(item, f"{where}[{index}]")
    elif isinstance(node, dict):
        for key, item in node.items():
            yield from recipe_nodes(item, f"{where}.{key}")


def _joined(where: str, name: str) -> str:
    return f"{where}.{name}" if where else name


def check_recipe(method: str, config: BaseModel) -> None:
    """Every parameter known, in a block where it applies, valid; another method's parameter is only warned about."""
    names, others = list(declared(method)), declared_by_other_methods(method)
    ignored: dict[str, list[str]] = {}
    values: dict[str, list[tuple[Any, str]]] = {}
    for where, name, setting, in_model_block in _parameter_settings(config):
        if name not in names and name in others and close_match(name, names) is None:
            ignored.setdefault(name, []).append(where)
            continue
        spec = parameter_spec(method, name, where)  # an unknown name is refused even with no value
        if in_model_block and not per_model(spec):
            raise ParameterError(
                f"{method}: parameter {name!r} in {where} is set for one model, but {name} applies to the whole "
                f"merge and mergekit would ignore it there: move it to the top-level `parameters:`"
                f"{_SHARED_SCOPE.get(name, '')}"
            )
        for scalar in _scalars(setting):
            values.setdefault(name, []).append((check_parameter(method, name, scalar, where), where))
    for name, places in ignored.items():
        users = [other for other in METHOD_NAMES if name in declared(other)]
        hint = f"; set merge_method: {' or '.join(users)} to use it" if users else ""
        owners = sorted(set(others[name]))
        listing = ", ".join(owners[:4]) + (f" and {len(owners) - 4} more" if len(owners) > 4 else "")
        LOG.warning(
            "%s ignores parameter %r (in %s): it is a parameter of %s, not of %s%s",
            method,
            name,
            ", ".join(places),
            listing,
            method,
            hint,
        )
    if "r" in names:
        found = {name: [(declared(method)[name].default, "the defaults")] for name in ("r", "alpha", "rule")}
        found.update(values)
        r, where = max(found["r"])
        check_lambda_range(
            method, r, [alpha for alpha, _ in found["alpha"]], [rule for rule, _ in found["rule"]], where
        )


def _parameter_settings(config: Any) -> Iterator[tuple[str, str, Any, bool]]:
    """(where, name, setting, in one model's block) for each ``parameters`` entry of a recipe."""
    for where, node in recipe_nodes(config):
        fields = type(node).model_fields  # "model": models[i], slices[j].sources[i]
        if "parameters" in fields and isinstance(node.parameters, dict):
            for name, setting in node.parameters.items():
                yield _joined(where, "parameters"), name, setting, "model" in fields


def _scalars(setting: Any) -> Iterator[Any]:
    if isinstance(setting, list):
        for item in setting:
            yield from _scalars(item)
    elif isinstance(setting, BaseModel) and hasattr(setting, "value"):
        yield from _scalars(setting.value)
    else:
        yield setting


def check_recipe_keys(method: str, raw: Any, schema: type[BaseModel]) -> None:
    """Refuse keys of ``raw`` that ``schema`` drops (``paramaters:``); an invalid recipe is mergekit's to report."""
    try:
        validated = schema.model_validate(raw)
    except Exception:  # noqa: BLE001 - mergekit reads the recipe again and says what is wrong
        return
    for where, key, valid in _unknown_keys(raw, validated, ""):
        place = f"in `{where}`" if where else "at the top level of the recipe"
        if key in declared(method) and "parameters" in valid:
            target = (
                f"`{where}.parameters:`"
                if per_model(declared(method)[key]) and where
                else "the top-level `parameters:`"
            )
            fix = f": {key!r} is a parameter of {method}; set it under {target}"
        else:
            hint = close_match(key, valid)
            fix = f" (did you mean {hint!r}?)" if hint else ""
        raise RecipeError(
            f"{method} recipe: unknown key {key!r} {place}, which mergekit would ignore{fix}; "
            f"valid keys there: {', '.join(valid)}"
        )


def _unknown_keys(raw: Any, validated: Any, where: str) -> Iterator[tuple[str, str, tuple[str, ...]]]:
    fields = None
    if isinstance(validated, BaseModel):
        if type(validated).__module__ not in _RECIPE_MODULES:
            return
        fields, validated = tuple(type(validated).model_fields), dict(validated)
    if isinstance(raw, dict) and isinstance(validated, dict):
        for key, value in raw.items():
            if fields is not None and key not in fields:
                yield where, str(key), fields
            else:
                yield from _unknown_keys(value, validated.get(key), f"{where}.{key}" if where else str(key))
    elif isinstance(raw, list) and isinstance(validated, (list, tuple)):
        for index, (value, item) in enumerate(zip(raw, validated)):
            yield from _unknown_keys(value, item, f"{where}[{index}]")


@dataclass(frozen=True)
class Stage:
    """One document of a recipe file; ``depends_on``: the earlier stages whose output it merges."""

    name: Optional[str]
    config: Any  # mergekit.config.MergeConfiguration, model paths of earlier stages resolved
    depends_on: tuple[str, ...] = ()

    @property
    def label(self) -> str:
        return self.name if self.name is not None else "(unnamed final stage)"


def read_stages(path: str, intermediate_dir: str = "") -> list[Stage]:
    """A recipe file's stages as mergekit-multi reads them (one stage for a plain recipe); a model named like a
    stage becomes a dependency. YAML and schema errors are one line naming the file and the place."""
    recipe_class = internal("mergekit.config", "MergeConfiguration")
    patched_config = internal("mergekit.scripts.multimerge", "patched_config")
    stages: dict[Optional[str], Any] = {}
    for index, document in enumerate(_documents(path)):
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
        try:
            stages[name] = recipe_class.model_validate(document)
        except (RuntimeError, ValueError) as error:  # mergekit's validators raise RuntimeError too
            if not isinstance(error, ValidationError):
                raise RecipeError(f"{path}{where}: not a valid mergekit recipe: {error}") from None
            problems = error.errors(include_url=False)
            shown = [
                f"{'.'.join(map(str, problem['loc'])) or 'the document'}: {problem['msg']}" for problem in problems[:3]
            ]
            more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
            raise RecipeError(f"{path}{where}: not a valid mergekit recipe: {'; '.join(shown)}{more}") from None
    result = []
    for name, config in stages.items():
        patched, used = patched_config(config, set(stages), intermediate_dir)
        result.append(Stage(name=name, config=patched, depends_on=tuple(sorted(used))))
    return result


def _documents(path: str) -> list[Any]:
    """The non-empty YAML documents of a recipe file."""
    try:
        with open(path, encoding="utf-8") as handle:
            documents = list(yaml.safe_load_all(handle))
    except (OSError, UnicodeDecodeError) as error:
        raise RecipeError(f"cannot read {path} as UTF-8 text ({error})") from None
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        detail = ", ".join(part for part in (getattr(error, "context", None), getattr(error, "problem", None)) if part)
        raise RecipeError(f"{path}: invalid YAML{at}: {detail or error}") from None
    except (ValueError, RecursionError) as error:  # a value yaml cannot convert (a date 2020-13-45), or too deep
        raise RecipeError(f"{path}: invalid YAML: a value cannot be read ({type(error).__name__}: {error})") from None
    return [document for document in documents if document is not None]


def stage_output(intermediate_dir: str, name: str) -> Optional[str]:
    """The finished output of an earlier stage under ``intermediate_dir``, if it is there."""
    path = os.path.join(intermediate_dir, name)
    return path if intermediate_dir and os.path.exists(os.path.join(path, "config.json")) else None
