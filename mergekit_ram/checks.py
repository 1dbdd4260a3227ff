"""Up-front checks of a RAM merge: the recipe's models, then every input tensor's header.

Everything here runs before any tensor data is read or any file written. Safetensors
headers give names, shapes and dtypes for free, so a missing tensor, a shape mismatch or a
truncated file is refused with the model and tensor named, instead of failing halfway.
"""

from __future__ import annotations

import glob
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Optional

from mergekit.io.tasks import GatherTensors, LoaderCache
from mergekit.merge_methods.task_adapter import ExecuteMergeMethodTask, TensorDictWrapper
from safetensors import SafetensorError, safe_open

from mergekit_ram.errors import RamError

LOG = logging.getLogger(__name__)


class InputError(RamError, ValueError):
    """A model or tensor a RAM merge cannot use; the message names it."""


def check_models(config: Any) -> None:
    """A base model is set; every model is listed once (however spelled); local paths exist."""
    base = getattr(config, "base_model", None)
    if base is None:
        raise InputError(
            f"{config.merge_method} needs `base_model`: RAM merges task vectors (fine-tune minus base) and "
            "has no meaning without the common base"
        )
    check_listed_once(base, _model_lists(config))
    headers = _Headers()
    for model in [base, *_listed_models(config)]:
        for path in _local_paths(model):
            if not os.path.exists(path):
                raise InputError(f"model path {path} does not exist")
            files = [path] if os.path.isfile(path) else sorted(glob.glob(os.path.join(path, "*.safetensors")))
            for file in files:
                headers.read(str(model), file)


def model_identity(model: Any) -> tuple[Optional[str], ...]:
    """What makes two references one model: the real path of a local model (``./ft``, ``ft/``,
    symlinks and ``~`` resolved) or the Hub id, with its revision, LoRA and architecture override."""
    if isinstance(model, str):
        return (_real_path(model), None, None, None, None)
    lora = model.lora
    return (
        _real_path(model.model.path),
        model.model.revision,
        _real_path(lora.path) if lora is not None else None,
        lora.revision if lora is not None else None,
        model.override_architecture,
    )


def _real_path(path: str) -> str:
    """A local path as the file system resolves it (mergekit takes an existing path as local); else the id."""
    expanded = os.path.expanduser(path)
    return os.path.realpath(expanded) if os.path.exists(expanded) else path


def check_listed_once(base: Any, model_lists: Iterable[tuple[str, list[Any]]]) -> None:
    """No model twice in one list, and the base not among the fine-tunes, under any spelling.

    mergekit compares references as written, so ``ft`` and ``./ft/`` would be two agents and
    RAM would count one model's changes twice (its updates would all look shared).
    """
    base_identity = model_identity(base)
    base_path = str(base) if isinstance(base, str) else base.model.path
    for where, models in model_lists:
        seen: dict[tuple[Optional[str], ...], Any] = {}
        for model in models:
            identity = model_identity(model)
            if identity == base_identity and (where.endswith("models") or model != base):
                raise InputError(
                    f"the base model {base_path} is also listed under `{where}` as {model}: list only the "
                    "fine-tuned models, each once (RAM would otherwise merge one agent fewer than you expect)"
                )
            if identity in seen:
                raise InputError(
                    f"{model} and {seen[identity]} in `{where}` are the same model ({identity[0]}): list each "
                    "fine-tuned model once (RAM would count its changes twice, all as shared)"
                )
            seen[identity] = model


def _model_lists(config: Any) -> Iterator[tuple[str, list[Any]]]:
    """Each list of a recipe's input models, with where it is: models, each slice's sources, modules."""
    if getattr(config, "models", None):
        yield "models", [entry.model for entry in config.models]
    for index, output_slice in enumerate(getattr(config, "slices", None) or []):
        yield f"slices[{index}].sources", [source.model for source in output_slice.sources]
    for name, module in (getattr(config, "modules", None) or {}).items():
        if module.models:
            yield f"modules.{name}.models", [entry.model for entry in module.models]
        for index, output_slice in enumerate(module.slices or []):
            yield f"modules.{name}.slices[{index}].sources", [source.model for source in output_slice.sources]


def _listed_models(config: Any) -> list[Any]:
    return [model for _, models in _model_lists(config) for model in models]


def _local_paths(model: Any) -> Iterator[str]:
    """Paths that must exist: absolute or explicitly relative ones (not Hub ids)."""
    references = [model] if isinstance(model, str) else [model.model] + ([model.lora] if model.lora else [])
    for reference in references:
        path = reference if isinstance(reference, str) else reference.path
        if os.path.isabs(path) or path.startswith((".", "~")):
            yield os.path.expanduser(path)


@dataclass(frozen=True)
class TensorHeader:
    file: str
    shape: tuple[int, ...]
    dtype: str


@dataclass
class InputFacts:
    """What the headers said: checkpoint dtypes per model (for the statistics' warnings)."""

    dtypes: dict[str, set[str]] = field(default_factory=dict)


class _Headers:
    """Reads each safetensors header once."""

    def __init__(self) -> None:
        self._files: dict[str, dict[str, TensorHeader]] = {}

    def get(self, model: str, file: str, name: str) -> Optional[TensorHeader]:
        if not file.endswith(".safetensors"):
            return None
        return self.read(model, file).get(name)

    def read(self, model: str, file: str) -> dict[str, TensorHeader]:
        if file not in self._files:
            try:
                with safe_open(file, framework="pt") as handle:
                    self._files[file] = {
                        key: TensorHeader(
                            file, tuple(handle.get_slice(key).get_shape()), handle.get_slice(key).get_dtype()
                        )
                        for key in handle.keys()
                    }
            except (SafetensorError, OSError) as error:
                raise InputError(f"{model}: cannot read {file} ({error}); the file is truncated or corrupt") from None
        return self._files[file]


def check_tensors(merge_tasks: Iterable[ExecuteMergeMethodTask]) -> InputFacts:
    """Every input present where others have it, with matching shapes, in readable files."""
    headers = _Headers()
    facts = InputFacts()
    for task in merge_tasks:
        found: dict[str, TensorHeader] = {}
        missing: list[str] = []
        for model, file, name in task_inputs(task):
            header = headers.get(model, file, name) if file is not None else None
            if file is None:
                missing.append(model)
            elif header is not None:
                found[model] = header
                facts.dtypes.setdefault(model, set()).add(header.dtype)
        output = task.output_weight.name
        if missing and found and not task.output_weight.optional:
            raise InputError(
                f"{missing[0]} has no tensor for {output}, which {', '.join(found)} "
                f"{'has' if len(found) == 1 else 'have'}; the models do not share an architecture"
            )
        if _aligns_vocabulary(task):
            continue
        shapes = {model: header.shape for model, header in found.items()}
        if len(set(shapes.values())) > 1:
            (first, first_shape), *rest = shapes.items()
            other, other_shape = next((m, s) for m, s in rest if s != first_shape)
            hint = (
                " (different vocabulary sizes: set `tokenizer_source`, e.g. base or union)"
                if task.output_weight.vocabulary_axis is not None
                else ""
            )
            raise InputError(
                f"tensor {output} has shape {list(other_shape)} in {other} but {list(first_shape)} in {first}{hint}"
            )
    return facts


def _aligns_vocabulary(task: ExecuteMergeMethodTask) -> bool:
    """Tokenizer alignment (or truncation) reshapes the vocabulary axis before the kernel."""
    return not isinstance(task.gather_tensors, (GatherTensors, TensorDictWrapper))


def task_inputs(task: ExecuteMergeMethodTask) -> Iterator[tuple[str, Optional[str], str]]:
    """(model, file holding the tensor or None, name in that file) for each input."""
    source = task.gather_tensors
    if isinstance(source, TensorDictWrapper):
        for model, load in source.tensors.items():
            yield str(model), load.model, load.tensor_name
        return
    gather = source if isinstance(source, GatherTensors) else source.gather_tensors
    for model, weight in gather.weight_info.items():
        index = LoaderCache().get(model).index
        names = [weight.name, *(weight.aliases or ()), *(weight.tied_names or ())]
        name = next((n for n in names if n in index.tensor_paths), None)
        if name is None:
            yield str(model), None, weight.name
        else:
            yield str(model), os.path.join(index.base_path, index.tensor_paths[name]), name
