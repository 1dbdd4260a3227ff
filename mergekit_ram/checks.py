"""Up-front checks of a RAM merge: the recipe's models, then every input tensor's header (once per merge),
before any tensor data is read or any file written, so a bad input is one line naming the model and tensor.
A model folder is read as mergekit 0.1.5 reads it, its names and files a stranger's (``mergekit_ram.files``).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, NamedTuple, Optional, Sequence

from safetensors import SafetensorError, safe_open

from mergekit_ram.errors import InputError
from mergekit_ram.files import UnreadableFile, open_regular, plain_name, read_json
from mergekit_ram.parameters import METHOD_NAMES, close_match
from mergekit_ram.planned import ModelIdentity, PlannedTensor

#: mergekit 0.1.5's weights in a model folder, in the order it looks for them (``ShardedTensorIndex.from_disk``).
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
INDEX_SUFFIX = ".index.json"
_LFS_POINTER = b"version https://git-lfs.github.com/spec/"


def close_method(name: str) -> Optional[str]:
    """The method of ours ``name`` misspells (``RAM+``, ``ram-plus``, ``ram_pluss``), if any."""
    if name in METHOD_NAMES:
        return None
    spelled = name.strip().lower().replace("-", "_").replace("+", "_plus")
    return spelled if spelled in METHOD_NAMES else close_match(spelled, METHOD_NAMES)


class TensorHeader(NamedTuple):
    shape: tuple[int, ...]
    dtype: str


def read_header(model: str, file: str) -> Optional[dict[str, TensorHeader]]:
    """The header of the file, checked regular (a FIFO is not waited on); None for a ``.bin`` file, which mergekit
    loads itself with ``weights_only``."""
    try:
        with open_regular(file) as (handle, _):
            if not file.lower().endswith(".safetensors"):  # mergekit's test (``TensorLoader.get``)
                return None
            if os.pread(handle, len(_LFS_POINTER), 0) == _LFS_POINTER:
                raise InputError(
                    f"{model}: {file} is a git-LFS pointer, not the weights: run `git lfs pull` in the model's "
                    "folder, or download the model again"
                )
            with safe_open(file, framework="pt") as opened:
                parts = {name: opened.get_slice(name) for name in opened.keys()}
        return {name: TensorHeader(tuple(part.get_shape()), part.get_dtype()) for name, part in parts.items()}
    except (UnreadableFile, OSError) as error:
        reason = error.strerror if isinstance(error, OSError) and error.strerror else error
        raise InputError(
            f"{model}: cannot read {file} ({reason}); put the model's weights file there (download or copy the "
            "model again)"
        ) from None
    except SafetensorError as error:
        reason = str(error).removeprefix("Error while deserializing header: ")
        raise InputError(
            f"{model}: cannot read {file} ({reason}); the file is truncated or corrupt: download or copy it again"
        ) from None


class HeaderCache:
    """Headers by real path (the checks and mergekit's index may spell a model's folder differently)."""

    def __init__(self) -> None:
        self._files: dict[str, Optional[dict[str, TensorHeader]]] = {}

    def get(self, model: str, file: Optional[str], name: str) -> Optional[TensorHeader]:
        return None if file is None else (self.read(model, file) or {}).get(name)

    def read(self, model: str, file: str) -> Optional[dict[str, TensorHeader]]:
        key = os.path.realpath(file)
        if key not in self._files:
            self._files[key] = read_header(model, file)
        return self._files[key]

    @property
    def files_read(self) -> int:
        return len(self._files)


def mergekit_weights(folder: str) -> Optional[str]:
    """The first of WEIGHT_FILES whose index (first) or file exists, as mergekit 0.1.5 chooses; None if none."""
    for name in WEIGHT_FILES:
        for candidate in (os.path.join(folder, name + INDEX_SUFFIX), os.path.join(folder, name)):
            if os.path.exists(candidate):
                return candidate
    return None


def read_index(model: str, index: str) -> dict[str, str]:
    """Its ``weight_map``, of plain file names (mergekit joins each to the folder: ``../x`` is outside it)."""
    try:
        data = read_json(index)
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict):
            raise UnreadableFile("it has no `weight_map` object of tensor names to file names")
    except (UnreadableFile, OSError) as error:
        raise InputError(f"{model}: cannot use its index {index} ({error}); download or copy the model again") from None
    for tensor, name in weight_map.items():
        if not plain_name(name):
            raise InputError(
                f"{model}: its index {index} puts {tensor!r} in {name!r}, which is not a file in the model's "
                "folder (mergekit would read outside it); download or copy the model again"
            )
    return weight_map


def check_weights(model: ModelIdentity, headers: HeaderCache) -> dict[str, TensorHeader]:
    """The tensors of the files mergekit 0.1.5 will read for a local model (none from a ``.bin``)."""
    chosen = mergekit_weights(model.path) if os.path.isdir(model.path) else model.path
    if chosen is None:
        return {}
    if not chosen.endswith(INDEX_SUFFIX):
        return headers.read(model.label, chosen) or {}
    found = {}
    for tensor, name in read_index(model.label, chosen).items():
        tensors = headers.read(model.label, os.path.join(model.path, name))
        if tensors is not None and tensor not in tensors:
            raise InputError(
                f"{model.label}: its index {chosen} puts {tensor!r} in {name}, which does not hold it; "
                "download or copy the model again"
            )
        if tensors is not None:
            found[tensor] = tensors[tensor]
    return found


def read_config(model: ModelIdentity) -> dict[str, Any]:
    """A local model folder's ``config.json``; {} where there is none (a Hub id, a ``mergekit-pytorch`` file)."""
    path = os.path.join(model.path, "config.json")
    if not os.path.isdir(model.path) or not os.path.lexists(path):
        return {}
    try:
        config = read_json(path)
        if not isinstance(config, dict):
            raise UnreadableFile("it is not a JSON object")
    except (UnreadableFile, OSError) as error:
        raise InputError(f"{model.label}: cannot use {path} ({error}); download or copy the model again") from None
    return config


@dataclass(frozen=True)
class BaseFit:
    """Of mergekit: whether it merges two architectures (None: ``--allow-crimes``), an architecture's
    vocabulary axes, and whether ``tokenizer_source`` is set."""

    same_architecture: Optional[Callable[[str, str], bool]] = None
    vocabulary_axes: Callable[[str], Mapping[str, int]] = lambda architecture: {}
    vocabulary_aligned: bool = False


def check_models(
    method: str,
    base: Optional[ModelIdentity],
    model_lists: Sequence[tuple[str, Sequence[ModelIdentity]]],
    headers: HeaderCache,
    fit: BaseFit = BaseFit(),
    lora_cache: bool = True,
) -> None:
    """A base model, each model listed once, local paths that exist with readable weights and no adapter folder
    where a model is, a folder to merge adapters in (``lora_cache``: ``--lora-merge-cache``), each fitting the
    base."""
    if base is None:
        raise InputError(
            f"{method} needs `base_model`: RAM merges task vectors (fine-tune minus base) and "
            "has no meaning without the common base"
        )
    check_listed_once(base, model_lists)
    tensors: dict[tuple[Optional[str], ...], dict[str, TensorHeader]] = {}
    for model in [base, *(model for _, models in model_lists for model in models)]:
        for path in model.local_paths:
            if not os.path.exists(path):
                relative = (
                    "" if os.path.isabs(path) else f" (relative to {os.getcwd()}, the folder the command runs in)"
                )
                raise InputError(f"model path {path} does not exist{relative}")
        check_not_an_adapter(model)
        if model.lora_path is not None and not lora_cache:
            raise InputError(
                f"{model.label} merges the adapter {model.lora_path} onto {model.path} before RAM merges it, which "
                "mergekit does in a folder of yours: give --lora-merge-cache DIR"
            )
        if os.path.exists(model.path):
            tensors[model.key] = check_weights(model, headers)
    base_files = (base, read_config(base), tensors.get(base.key, {}))
    for where, models in model_lists:
        for model in models:
            model_files = (model, read_config(model), tensors.get(model.key, {}))
            check_fits_base(model_files, base_files, fit, whole_model=where.endswith("models"))


def check_not_an_adapter(model: ModelIdentity) -> None:
    """A LoRA adapter's folder (``adapter_config.json``, no ``config.json``) given as a model: the form that merges
    it onto its base, with the base its config names where that reads as a model reference."""
    config = os.path.join(model.path, "adapter_config.json")
    if not os.path.isdir(model.path) or os.path.lexists(os.path.join(model.path, "config.json")):
        return
    if not os.path.lexists(config):
        return
    try:
        named = read_json(config).get("base_model_name_or_path")
    except (UnreadableFile, OSError, AttributeError):
        named = None
    base = named if isinstance(named, str) and 0 < len(named) <= 200 and named.isprintable() else "BASE"
    raise InputError(
        f"{model.label} is a LoRA adapter (adapter_config.json, no config.json), not a model: give it as "
        f"`model: {base}+{model.label}` (its base, then +, then the adapter) and run with --lora-merge-cache DIR"
    )


#: A model, its ``config.json`` and its tensors' headers.
ModelFiles = tuple[ModelIdentity, dict[str, Any], dict[str, TensorHeader]]


def check_fits_base(model: ModelFiles, base: ModelFiles, fit: BaseFit, whole_model: bool) -> None:
    """Architecture, depth (of a whole model) and shapes; a vocabulary size passes where the recipe aligns them."""
    (identity, config, tensors), (base_identity, base_config, base_tensors) = model, base
    name, base_name = _architecture(identity, config), _architecture(base_identity, base_config)
    if fit.same_architecture is not None and name and base_name and not fit.same_architecture(name, base_name):
        raise InputError(
            f"{identity.label} is a {name} but the base model {base_identity.label} is a {base_name} "
            "(`architectures` in their config.json): RAM merges fine-tunes of one base model "
            "(--allow-crimes lets mergekit merge other architectures anyway)"
        )
    layers = [config.get("num_hidden_layers"), base_config.get("num_hidden_layers")]
    if whole_model and all(type(count) is int for count in layers) and layers[0] != layers[1]:
        raise InputError(
            f"{identity.label} has {layers[0]} layers but the base model {base_identity.label} has {layers[1]} "
            "(`num_hidden_layers` in their config.json): RAM merges fine-tunes of one base model, which keep "
            "its layers"
        )
    axes = fit.vocabulary_axes(base_name) if base_name else {}
    for tensor, header in tensors.items():
        reference = base_tensors.get(tensor)
        if reference is None or reference.shape == header.shape:
            continue
        vocabulary = tensor in axes and differing_axis(header.shape, reference.shape) == axes[tensor]
        if not (vocabulary and fit.vocabulary_aligned):
            label = f"the base model {base_identity.label}"
            raise shape_error(tensor, identity.label, header.shape, label, reference.shape, vocabulary)


def _architecture(model: ModelIdentity, config: dict[str, Any]) -> Optional[str]:
    """The architecture mergekit takes a model for: its override, else its config.json's one."""
    names = config.get("architectures")
    if model.override_architecture is not None:
        return model.override_architecture
    return names[0] if isinstance(names, list) and len(names) == 1 and isinstance(names[0], str) else None


def differing_axis(shape: tuple[int, ...], reference: tuple[int, ...]) -> Optional[int]:
    """The one axis along which two shapes of the same rank differ; None for another rank or several axes."""
    axes = [axis for axis, (one, other) in enumerate(zip(shape, reference)) if one != other]
    return axes[0] if len(shape) == len(reference) and len(axes) == 1 else None


def shape_error(
    name: str, model: str, shape: tuple[int, ...], reference: str, reference_shape: tuple[int, ...], vocabulary: bool
) -> InputError:
    """The vocabulary hint only where the shapes differ along the vocabulary axis alone."""
    hint = " (different vocabulary sizes: set `tokenizer_source`, e.g. base or union)" if vocabulary else ""
    return InputError(
        f"tensor {name} has shape {list(shape)} in {model} but {list(reference_shape)} in {reference}{hint}"
    )


def check_listed_once(base: ModelIdentity, model_lists: Iterable[tuple[str, Sequence[ModelIdentity]]]) -> None:
    """No model twice in a list, nor the base among the fine-tunes, under any spelling (mergekit's is as written)."""
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
                    f"{model.described} and {seen[model.key].described} in `{where}` are the same model "
                    f"({model.path}): list each fine-tuned model once (RAM would count its changes twice, all as "
                    "shared)"
                )
            seen[model.key] = model


class InputFacts(NamedTuple):
    """Checkpoint dtypes per model, from the headers (for the statistics' warnings)."""

    dtypes: dict[str, set[str]]


def check_tensors(planned: Iterable[PlannedTensor], headers: HeaderCache) -> InputFacts:
    """Every input present where others have it, with matching shapes, in readable files."""
    facts = InputFacts({})
    for tensor in planned:
        found: dict[str, TensorHeader] = {}
        missing = [source.model for source in tensor.inputs if source.file is None]
        for source in tensor.inputs:
            header = headers.get(source.model, source.file, source.name)
            if header is not None:
                found[source.model] = header
                facts.dtypes.setdefault(source.model, set()).add(header.dtype)
        if missing and found and not tensor.optional:
            raise InputError(
                f"{missing[0]} has no tensor for {tensor.name}, which {', '.join(found)} "
                f"{'has' if len(found) == 1 else 'have'}; the models do not share an architecture"
            )
        if tensor.reshaped:  # alignment reshapes the inputs: their shapes may differ
            continue
        reference = tensor.base if tensor.base in found else next(iter(found), "")
        for model, header in found.items():
            if header.shape != found[reference].shape:
                axis = differing_axis(header.shape, found[reference].shape)
                vocabulary = axis is not None and axis == tensor.vocabulary_axis
                raise shape_error(tensor.name, model, header.shape, reference, found[reference].shape, vocabulary)
    return facts


def planned_numel(tensor: PlannedTensor, headers: HeaderCache) -> Optional[int]:
    """Elements of the tensor the kernel gets, from a header; None where alignment reshapes it."""
    if tensor.reshaped:
        return None
    for source in tensor.inputs:
        header = headers.get(source.model, source.file, source.name)
        if header is not None:
            return math.prod(header.shape)
    return None
