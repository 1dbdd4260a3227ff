"""Up-front checks of a RAM merge: the recipe's models, then every input tensor's header.

Everything here runs before any tensor data is read or any file written. Safetensors
headers give names, shapes and dtypes for free, so a missing tensor, a shape mismatch or a
truncated file is refused with the model and tensor named, instead of failing halfway.
Each header is read once per merge: one ``HeaderCache`` serves the model and tensor checks.
Plain data in (``mergekit_ram.planned``), no mergekit.
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass, field
from typing import Iterable, Optional, Sequence

from safetensors import SafetensorError, safe_open

from mergekit_ram.errors import InputError
from mergekit_ram.planned import ModelIdentity, PlannedTensor


@dataclass(frozen=True)
class TensorHeader:
    file: str
    shape: tuple[int, ...]
    dtype: str


class HeaderCache:
    """Reads each safetensors header once; a file that cannot be read is an InputError."""

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

    @property
    def files_read(self) -> int:
        return len(self._files)


def check_models(
    method: str,
    base: Optional[ModelIdentity],
    model_lists: Sequence[tuple[str, Sequence[ModelIdentity]]],
    headers: HeaderCache,
) -> None:
    """A base model is set; every model is listed once (however spelled); local paths exist and
    their safetensors files can be read."""
    if base is None:
        raise InputError(
            f"{method} needs `base_model`: RAM merges task vectors (fine-tune minus base) and "
            "has no meaning without the common base"
        )
    check_listed_once(base, model_lists)
    for model in [base, *(model for _, models in model_lists for model in models)]:
        for path in model.local_paths:
            if not os.path.exists(path):
                raise InputError(f"model path {path} does not exist")
            files = [path] if os.path.isfile(path) else sorted(glob.glob(os.path.join(path, "*.safetensors")))
            for file in files:
                headers.read(model.label, file)


def check_listed_once(base: ModelIdentity, model_lists: Iterable[tuple[str, Sequence[ModelIdentity]]]) -> None:
    """No model twice in one list, and the base not among the fine-tunes, under any spelling.

    mergekit compares references as written, so ``ft`` and ``./ft/`` would be two agents and
    RAM would count one model's changes twice (its updates would all look shared).
    """
    for where, models in model_lists:
        seen: dict[tuple[Optional[str], ...], ModelIdentity] = {}
        for model in models:
            if model.key == base.key and (where.endswith("models") or model.label != base.label):
                raise InputError(
                    f"the base model {base.label} is also listed under `{where}` as {model.label}: list only the "
                    "fine-tuned models, each once (RAM would otherwise merge one agent fewer than you expect)"
                )
            if model.key in seen:
                raise InputError(
                    f"{model.label} and {seen[model.key].label} in `{where}` are the same model ({model.path}): "
                    "list each fine-tuned model once (RAM would count its changes twice, all as shared)"
                )
            seen[model.key] = model


@dataclass
class InputFacts:
    """What the headers said: checkpoint dtypes per model (for the statistics' warnings)."""

    dtypes: dict[str, set[str]] = field(default_factory=dict)


def check_tensors(planned: Iterable[PlannedTensor], headers: HeaderCache) -> InputFacts:
    """Every input present where others have it, with matching shapes, in readable files."""
    facts = InputFacts()
    for tensor in planned:
        found: dict[str, TensorHeader] = {}
        missing: list[str] = []
        for source in tensor.inputs:
            if source.file is None:
                missing.append(source.model)
                continue
            header = headers.get(source.model, source.file, source.name)
            if header is not None:
                found[source.model] = header
                facts.dtypes.setdefault(source.model, set()).add(header.dtype)
        if missing and found and not tensor.optional:
            raise InputError(
                f"{missing[0]} has no tensor for {tensor.name}, which {', '.join(found)} "
                f"{'has' if len(found) == 1 else 'have'}; the models do not share an architecture"
            )
        if tensor.reshaped:
            continue
        shapes = {model: header.shape for model, header in found.items()}
        if len(set(shapes.values())) > 1:
            (first, first_shape), *rest = shapes.items()
            other, other_shape = next((m, s) for m, s in rest if s != first_shape)
            hint = (
                " (different vocabulary sizes: set `tokenizer_source`, e.g. base or union)"
                if tensor.vocabulary_axis is not None
                else ""
            )
            raise InputError(
                f"tensor {tensor.name} has shape {list(other_shape)} in {other} "
                f"but {list(first_shape)} in {first}{hint}"
            )
    return facts


def planned_numel(tensor: PlannedTensor, headers: HeaderCache) -> Optional[int]:
    """Elements of the tensor the kernel gets, from a safetensors header; None where alignment reshapes it."""
    if tensor.reshaped:
        return None
    for source in tensor.inputs:
        if source.file is not None:
            header = headers.get(source.model, source.file, source.name)
            if header is not None:
                size = 1
                for extent in header.shape:
                    size *= extent
                return size
    return None
