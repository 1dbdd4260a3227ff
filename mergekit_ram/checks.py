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
    """A base model is set and is not also listed as a fine-tune; local paths exist."""
    base = getattr(config, "base_model", None)
    if base is None:
        raise InputError(
            f"{config.merge_method} needs `base_model`: RAM merges task vectors (fine-tune minus base) and "
            "has no meaning without the common base"
        )
    base_path = base if isinstance(base, str) else base.model.path
    for entry in getattr(config, "models", None) or []:
        path = entry.model if isinstance(entry.model, str) else entry.model.model.path
        if entry.model == base or os.path.normpath(path) == os.path.normpath(base_path):
            raise InputError(
                f"the base model {base_path} is also listed under `models`: list only the fine-tuned models "
                "(RAM would otherwise merge one agent fewer than you expect)"
            )
    headers = _Headers()
    for model in [base, *_listed_models(config)]:
        for path in _local_paths(model):
            if not os.path.exists(path):
                raise InputError(f"model path {path} does not exist")
            files = [path] if os.path.isfile(path) else sorted(glob.glob(os.path.join(path, "*.safetensors")))
            for file in files:
                headers.read(str(model), file)


def _listed_models(config: Any) -> list[Any]:
    models = [entry.model for entry in getattr(config, "models", None) or []]
    for output_slice in getattr(config, "slices", None) or []:
        models += [source.model for source in output_slice.sources]
    return models


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
