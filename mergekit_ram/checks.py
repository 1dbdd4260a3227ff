"""Up-front checks of a RAM merge: the recipe's models, then every input tensor's header.

Everything here runs before any tensor data is read or any file written. Safetensors
headers give names, shapes and dtypes for free, so a missing tensor, a shape mismatch or a
truncated file is refused with the model and tensor named, instead of failing halfway.
Each header is read once per merge: one ``HeaderCache`` serves the model and tensor checks.
A model folder is read as mergekit 0.1.5 reads it: only the files its index names, or the
one file mergekit chooses; every name and file there is a stranger's (``mergekit_ram.files``).
Plain data in (``mergekit_ram.planned``), no mergekit.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

from safetensors import SafetensorError, safe_open

from mergekit_ram.errors import InputError
from mergekit_ram.files import UnreadableFile, open_regular, plain_name, read_at, read_json
from mergekit_ram.parameters import METHOD_PARAMETERS, close_match
from mergekit_ram.planned import ModelIdentity, PlannedTensor

#: mergekit 0.1.5's weights in a model folder, in the order it looks for them (``ShardedTensorIndex.from_disk``).
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
INDEX_SUFFIX = ".index.json"
_LFS_POINTER = b"version https://git-lfs.github.com/spec/"


def close_method(name: str) -> Optional[str]:
    """The method of this plugin (a key of ``METHOD_PARAMETERS``) that ``name`` misspells, if any: read in
    lower case with ``-`` as ``_`` and ``+`` as ``_plus`` (``RAM+``, ``ram-plus``), else the parameters'
    near-miss matcher (``ram_pluss``, ``rma``); none for a method of ours itself."""
    spelled = name.strip().lower().replace("-", "_").replace("+", "_plus")
    if name in METHOD_PARAMETERS or spelled in METHOD_PARAMETERS:
        return None if name in METHOD_PARAMETERS else spelled
    return close_match(spelled, METHOD_PARAMETERS)


@dataclass(frozen=True)
class TensorHeader:
    file: str
    shape: tuple[int, ...]
    dtype: str


def is_safetensors(file: str) -> bool:
    """Whether mergekit reads ``file`` as safetensors (``TensorLoader.get``: by its suffix, any case)."""
    return file.lower().endswith(".safetensors")


def read_header(model: str, file: str) -> Optional[dict[str, TensorHeader]]:
    """The tensors of a safetensors file, from its header as safetensors itself reads and checks it;
    None for another file (``.bin``), which is only checked to be a regular file.

    Non-blocking: a FIFO, device or folder is refused without being read or waited on, and
    safetensors maps the very file checked (its descriptor), reading only the header (a longer
    one than it allows is refused unread). ``.bin`` files are left to mergekit's own loading, its
    safe path: ``torch.load`` with ``weights_only`` (torch's default since 2.6, passed explicitly
    by ``DumbPytorchLoader``), or with ``--lazy-unpickle`` mergekit's ``LazyTorchUnpickler``, which
    admits tensor types only.
    """
    try:
        with open_regular(file) as (handle, _):
            if not is_safetensors(file):
                return None
            if read_at(handle, len(_LFS_POINTER), 0) == _LFS_POINTER:
                raise InputError(
                    f"{model}: {file} is a git-LFS pointer, not the weights: run `git lfs pull` in the model's "
                    "folder, or download the model again"
                )
            with safe_open(f"/dev/fd/{handle}", framework="pt") as opened:
                slices = {name: opened.get_slice(name) for name in opened.keys()}
        return {name: TensorHeader(file, tuple(part.get_shape()), part.get_dtype()) for name, part in slices.items()}
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
    """Each safetensors header read once per merge (``read_header``)."""

    def __init__(self) -> None:
        self._files: dict[str, Optional[dict[str, TensorHeader]]] = {}

    def get(self, model: str, file: str, name: str) -> Optional[TensorHeader]:
        tensors = self.read(model, file)
        return None if tensors is None else tensors.get(name)

    def read(self, model: str, file: str) -> Optional[dict[str, TensorHeader]]:
        """The file's tensors, or None for a file mergekit reads itself (not safetensors). Files are
        told apart by real path: the checks and mergekit's index may spell a model's folder differently."""
        key = os.path.realpath(file)
        if key not in self._files:
            self._files[key] = read_header(model, file)
        return self._files[key]

    @property
    def files_read(self) -> int:
        return len(self._files)


def mergekit_weights(folder: str) -> Optional[str]:
    """The file mergekit 0.1.5 reads a model folder through (``ShardedTensorIndex.from_disk``): the
    first of WEIGHT_FILES whose index or file exists, the index if both do; None if neither."""
    for name in WEIGHT_FILES:
        path = os.path.join(folder, name)
        for candidate in (path + INDEX_SUFFIX, path):
            if os.path.exists(candidate):
                return candidate
    return None


def read_index(model: str, index: str) -> dict[str, str]:
    """An index's ``weight_map``: tensor names to names of files beside it; anything else refused.

    mergekit joins each file name to the model's folder, so ``../x`` or an absolute path would
    be read from outside it.
    """
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
    """The tensors of the files mergekit 0.1.5 will read for a local model (an input file of
    ``mergekit-pytorch``, or a folder's index or chosen file), from their headers (none from a
    ``.bin`` file, which is mergekit's to read); stray files are never opened."""
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
    """A local model folder's ``config.json``, read bounded and without blocking (a stranger's file);
    {} where there is none (a Hub id, a ``mergekit-pytorch`` input file: mergekit reads those itself)."""
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
    """What ``check_fits_base`` needs of mergekit, which the boundary hands it: whether mergekit merges
    two architectures (None: not compared, its ``--allow-crimes``), the tensors of an architecture that
    have a vocabulary axis, and whether the recipe aligns vocabularies (``tokenizer_source``)."""

    same_architecture: Optional[Callable[[str, str], bool]] = None
    vocabulary_axes: Callable[[str], Mapping[str, int]] = lambda architecture: {}
    vocabulary_aligned: bool = False


def check_models(
    method: str,
    base: Optional[ModelIdentity],
    model_lists: Sequence[tuple[str, Sequence[ModelIdentity]]],
    headers: HeaderCache,
    fit: BaseFit = BaseFit(),
) -> None:
    """A base model is set; every model is listed once (however spelled); local paths exist, the weights
    mergekit will read can be read, and each model fits the base (``check_fits_base``)."""
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
                raise InputError(f"model path {path} does not exist")
        if os.path.exists(model.path):
            tensors[model.key] = check_weights(model, headers)
    base_files = (base, read_config(base), tensors.get(base.key, {}))
    for where, models in model_lists:
        for model in models:
            model_files = (model, read_config(model), tensors.get(model.key, {}))
            check_fits_base(model_files, base_files, fit, whole_model=where.endswith("models"))


#: A model, its ``config.json`` and its tensors' headers, as ``check_fits_base`` compares them.
ModelFiles = tuple[ModelIdentity, dict[str, Any], dict[str, TensorHeader]]


def check_fits_base(model: ModelFiles, base: ModelFiles, fit: BaseFit, whole_model: bool) -> None:
    """A model the base was not fine-tuned into is one line naming it and what differs, before mergekit
    reads a tensor (its own errors for these are tracebacks naming no model): another architecture,
    another depth (of a whole model, not a slice of it), or a tensor of another shape (the vocabulary
    hint only where the shapes differ along the tensor's vocabulary axis, which passes when the recipe
    aligns vocabularies)."""
    (identity, config, tensors), (base_identity, base_config, base_tensors) = model, base
    name, base_name = _architecture(identity, config), _architecture(base_identity, base_config)
    if fit.same_architecture is not None and name and base_name and not fit.same_architecture(name, base_name):
        raise InputError(
            f"{identity.label} is a {name} but the base model {base_identity.label} is a {base_name} "
            "(`architectures` in their config.json): RAM merges fine-tunes of one base model "
            "(--allow-crimes lets mergekit merge other architectures anyway)"
        )
    layers = [_integer(config, "num_hidden_layers"), _integer(base_config, "num_hidden_layers")]
    if whole_model and None not in layers and layers[0] != layers[1]:
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
    """The architecture mergekit takes a model for: its override, else the one its config.json names."""
    names = config.get("architectures")
    if model.override_architecture is not None:
        return model.override_architecture
    return names[0] if isinstance(names, list) and len(names) == 1 and isinstance(names[0], str) else None


def _integer(config: dict[str, Any], key: str) -> Optional[int]:
    value = config.get(key)
    return value if type(value) is int else None


def differing_axis(shape: tuple[int, ...], reference: tuple[int, ...]) -> Optional[int]:
    """The one axis along which two shapes of the same rank differ; None for another rank or several axes."""
    axes = [axis for axis, (one, other) in enumerate(zip(shape, reference)) if one != other]
    return axes[0] if len(shape) == len(reference) and len(axes) == 1 else None


def shape_error(
    name: str, model: str, shape: tuple[int, ...], reference: str, reference_shape: tuple[int, ...], vocabulary: bool
) -> InputError:
    """Tensor ``name`` has another shape in ``model`` than in ``reference``; the vocabulary hint only
    where the shapes differ along the vocabulary axis alone (elsewhere it would send the user astray)."""
    hint = " (different vocabulary sizes: set `tokenizer_source`, e.g. base or union)" if vocabulary else ""
    return InputError(
        f"tensor {name} has shape {list(shape)} in {model} but {list(reference_shape)} in {reference}{hint}"
    )


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
        reference = tensor.base if tensor.base in found else next(iter(found), "")
        for model, header in found.items():
            if header.shape != found[reference].shape:
                axis = differing_axis(header.shape, found[reference].shape)
                vocabulary = axis is not None and axis == tensor.vocabulary_axis
                raise shape_error(tensor.name, model, header.shape, reference, found[reference].shape, vocabulary)
    return facts


def planned_numel(tensor: PlannedTensor, headers: HeaderCache) -> Optional[int]:
    """Elements of the tensor the kernel gets, from a safetensors header; None where alignment reshapes it."""
    if tensor.reshaped:
        return None
    for source in tensor.inputs:
        if source.file is not None:
            header = headers.get(source.model, source.file, source.name)
            if header is not None:
                return math.prod(header.shape)
    return None
