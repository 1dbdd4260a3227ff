"""The plain layers below the mergekit boundary, on plain data: the merge's rule, checks, the cache.

Nothing here imports mergekit: tests/test_layers.py runs this file with mergekit made
unimportable.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Optional

import pytest
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from mergekit_ram import cache
from mergekit_ram.checks import (
    HeaderCache,
    check_listed_once,
    check_models,
    check_tensors,
    close_method,
    planned_numel,
)
from mergekit_ram.errors import DeviceError, InputError
from mergekit_ram.lambdas import Applied, Resolved, merge_rule
from mergekit_ram.parameters import ParameterError
from mergekit_ram.planned import ModelIdentity, PlannedTensor, TensorInput
from mergekit_ram.stats.data import TensorCounts
from mergekit_ram.stats.schema import counts_to_dict

#: ram_plus's whole-merge parameters and their defaults, as the registered method declares them.
RAM_PLUS = {"r": 0.1, "alpha": 2.0, "rule": "clip"}


def parameters(name: str, r: float = 0.1, alpha: float = 2.0, rule: str = "clip", **pins: tuple) -> Resolved:
    return Resolved(
        name=name,
        shared={"epsilon": 1e-5, "r": r, "alpha": alpha, "rule": rule},
        per_model={model: {"rho": rho, "lambda": lambda_} for model, (rho, lambda_) in pins.items()},
    )


def test_one_rescaling_per_merge_turns_rho_into_lambda() -> None:
    rule = merge_rule("ram_plus", [parameters("w1", a=(None, None)), parameters("w2", a=(None, None))], RAM_PLUS)
    assert rule.rescaling is not None and (rule.rescaling.r, rule.rescaling.alpha) == (0.1, 2.0)
    assert rule.needs_counts(["a"])
    counts = TensorCounts(name="w1", numel=100, epsilon=1e-5, models=("a",), histograms=((20,),))
    assert rule.applied(["a"], rule.statistics([counts], "pre-pass")) == {"a": Applied(1.0, 0.0)}
    refused = r"parameter 'r' must be one value for the whole merge .* 0.1 for w1 and 0.2 for w2"
    with pytest.raises(ParameterError, match=refused):
        merge_rule("ram_plus", [parameters("w1"), parameters("w2", r=0.2)], RAM_PLUS)


def test_pins_and_r_zero_need_no_counts() -> None:
    pinned = merge_rule("ram_plus", [parameters("w", a=(None, 1.3), b=(3.0, None))], RAM_PLUS)
    assert not pinned.needs_counts(["a", "b"])
    assert pinned.applied(["a", "b"], None) == {"a": Applied(1.3, None), "b": Applied(1.2, 3.0)}
    zero = merge_rule("ram_plus", [parameters("w", r=0.0, a=(None, None))], RAM_PLUS)
    assert not zero.needs_counts(["a"]) and zero.applied(["a"], None) == {"a": Applied(1.0, None)}
    ram = merge_rule("ram", [parameters("w")], {})
    assert ram.rescaling is None and ram.applied(["a"], None) == {"a": Applied(1.0, None)}
    with pytest.raises(ParameterError, match="the pinned lambda of a must be one value for the whole merge"):
        merge_rule("ram_plus", [parameters("w1", a=(None, 1.3)), parameters("w2", a=(None, None))], RAM_PLUS)


def test_reported_lambda_is_the_applied_lambda() -> None:
    rule = merge_rule("ram_plus", [parameters("w", a=(None, None), b=(None, 1.5))], RAM_PLUS)
    counts = TensorCounts(name="w", numel=10, epsilon=1e-5, models=("a", "b"), histograms=((2, 3), (1, 3)))
    statistics = rule.statistics([counts], "pre-pass")
    applied = rule.applied(["a", "b"], statistics)
    assert applied == {"a": Applied(1.15, 1.5), "b": Applied(1.5, None)}  # rho_a = 3 / 2
    assert {stats.model: stats.lambda_ for stats in statistics.models} == {"a": 1.15, "b": 1.5}


def identity(label: str, path: str) -> ModelIdentity:
    return ModelIdentity(label=label, path=path)


def test_each_model_once_under_any_spelling() -> None:
    base = identity("base", "/m/base")
    check_listed_once(base, [("models", [identity("a", "/m/a"), identity("b", "/m/b")])])
    with pytest.raises(InputError, match=r"^\./a/ and a in `models` are the same model \(/m/a\)"):
        check_listed_once(base, [("models", [identity("a", "/m/a"), identity("./a/", "/m/a")])])
    with pytest.raises(InputError, match=r"^the base model base is also listed under `models` as base/"):
        check_listed_once(base, [("models", [identity("base/", "/m/base")])])
    with pytest.raises(InputError, match="needs `base_model`"):
        check_models("ram", None, [], HeaderCache())


def write(path: str, **tensors: torch.Tensor) -> str:
    save_file(tensors, path)
    return path


def planned(name: str, *inputs: TensorInput, optional: bool = False) -> PlannedTensor:
    return PlannedTensor(
        name=name,
        optional=optional,
        vocabulary_axis=None,
        reshaped=False,
        base=inputs[0].model,
        finetunes=tuple(source.model for source in inputs[1:]),
        inputs=inputs,
        epsilon=1e-5,
        graph=f"graph of {name}",
    )


def test_headers_are_read_once_and_tensors_checked(tmp_path) -> None:
    base = write(str(tmp_path / "base.safetensors"), w=torch.zeros(2, 3), v=torch.zeros(4))
    agent = write(str(tmp_path / "a.safetensors"), w=torch.ones(2, 3, dtype=torch.bfloat16), v=torch.zeros(5))
    headers = HeaderCache()
    tensor = planned("w", TensorInput("base", base, "w"), TensorInput("a", agent, "w"))
    facts = check_tensors([tensor], headers)
    assert facts.dtypes == {"base": {"F32"}, "a": {"BF16"}}
    assert planned_numel(tensor, headers) == 6
    assert headers.files_read == 2
    with pytest.raises(InputError, match=r"^tensor v has shape \[5\] in a but \[4\] in base$"):
        check_tensors([planned("v", TensorInput("base", base, "v"), TensorInput("a", agent, "v"))], headers)
    assert headers.files_read == 2  # each header once
    # The vocabulary hint only where the shapes differ along the tensor's vocabulary axis (rows here).
    rows = write(str(tmp_path / "rows.safetensors"), more_rows=torch.zeros(5, 3), wider=torch.zeros(2, 4))
    for name, message in (
        ("more_rows", "[5, 3] in a but [2, 3] in base (different vocabulary sizes: set `tokenizer_source`, e.g. base"),
        ("wider", "[2, 4] in a but [2, 3] in base$"),
    ):
        tensor = planned(name, TensorInput("base", base, "w"), TensorInput("a", rows, name))
        with pytest.raises(InputError, match=re.escape(message).replace(r"\$", "$")):
            check_tensors([dataclasses.replace(tensor, vocabulary_axis=0)], headers)
    with pytest.raises(InputError, match="^a has no tensor for u, which base has; the models do not share"):
        check_tensors([planned("u", TensorInput("base", base, "w"), TensorInput("a", None, "u"))], headers)
    check_tensors([planned("u", TensorInput("base", base, "w"), TensorInput("a", None, "u"), optional=True)], headers)
    truncated = str(tmp_path / "t.safetensors")
    with open(base, "rb") as source, open(truncated, "wb") as target:
        target.write(source.read()[:20])
    with pytest.raises(InputError, match=r"^a: cannot read .*t\.safetensors .* truncated or corrupt: download or"):
        headers.read("a", truncated)
    (tmp_path / "pytorch_model.bin").write_bytes(b"not parsed here")
    assert headers.read("a", str(tmp_path / "pytorch_model.bin")) is None  # mergekit reads it itself


def raw(path: str, header: bytes, data: bytes = b"", length: Optional[int] = None) -> str:
    """A file laid out as safetensors: 8-byte little-endian header length, header, data."""
    with open(path, "wb") as handle:
        handle.write((len(header) if length is None else length).to_bytes(8, "little") + header + data)
    return path


_U8 = b'"t": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}'
#: Crafted files, each read by safetensors itself and by the plugin's header check.
HEADERS = {
    "valid, with metadata": (b"{" + _U8 + b', "__metadata__": {"format": "pt"}}', b"ab"),
    "whitespace around the JSON": (b" {" + _U8 + b"}\n ", b"ab"),
    "no tensors": (b"{}", b""),
    "an empty tensor and a scalar": (
        b'{"e": {"dtype": "F32", "shape": [0, 3], "data_offsets": [0, 0]}, '
        b'"s": {"dtype": "F32", "shape": [], "data_offsets": [0, 4]}}',
        b"abcd",
    ),
    "sub-byte dtypes": (
        b'{"a": {"dtype": "F4", "shape": [4], "data_offsets": [0, 2]}, '
        b'"b": {"dtype": "F6_E2M3", "shape": [4], "data_offsets": [2, 5]}}',
        b"abcde",
    ),
    "data cut short": (b"{" + _U8 + b"}", b"a"),
    "bytes after the data": (b"{" + _U8 + b"}", b"abc"),
    "a gap before a tensor": (b'{"t": {"dtype": "U8", "shape": [1], "data_offsets": [1, 2]}}', b"ab"),
    "two tensors on the same bytes": (b"{" + _U8 + b", " + _U8.replace(b'"t"', b'"u"') + b"}", b"ab"),
    "a size that does not fit the shape": (b'{"t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 2]}}', b"ab"),
    "an unknown dtype": (b'{"t": {"dtype": "Q8", "shape": [2], "data_offsets": [0, 2]}}', b"ab"),
    "a negative extent": (b'{"t": {"dtype": "U8", "shape": [-2], "data_offsets": [0, 2]}}', b"ab"),
    "a boolean offset": (b'{"t": {"dtype": "U8", "shape": [2], "data_offsets": [false, 2]}}', b"ab"),
    "three offsets": (b'{"t": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2, 2]}}', b"ab"),
    "half a byte of F4": (b'{"t": {"dtype": "F4", "shape": [3], "data_offsets": [0, 2]}}', b"ab"),
    "metadata that is not strings": (b'{"__metadata__": {"n": 1}}', b""),
    "a list, not an object": (b"[1]", b""),
    "bytes after the JSON": (b"{}\0", b""),
    "not UTF-8": (b'{"\xff": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}}', b"ab"),
    "zeros (a sparse file)": (b"", b"\0" * 64),
}


@pytest.mark.parametrize("case", list(HEADERS), ids=list(HEADERS))
def test_headers_are_checked_as_safetensors_checks_them(tmp_path, case: str) -> None:
    file = raw(str(tmp_path / "m.safetensors"), *HEADERS[case])
    try:
        with safe_open(file, framework="pt") as handle:
            expected: Optional[list[str]] = sorted(handle.keys())
    except SafetensorError:
        expected = None
    try:
        found: Optional[list[str]] = sorted(HeaderCache().read("m", file) or {})
    except InputError as error:
        assert "the file is truncated or corrupt" in str(error) and "\n" not in str(error)
        found = None
    assert found == expected


#: safetensors' own bound on a header (``MAX_HEADER_SIZE``): a longer one is refused unread.
HEADER_LIMIT = 100_000_000


def test_a_header_is_read_bounded_and_never_waited_on(tmp_path) -> None:
    """A longer header than safetensors allows is refused unread; a FIFO, a device or a folder unopened."""
    too_long = raw(str(tmp_path / "long.safetensors"), b"{}", length=HEADER_LIMIT + 1)
    os.truncate(too_long, HEADER_LIMIT + 64)  # sparse: the announced header is there, but never read
    with pytest.raises(InputError, match=r"\(header too large\); the file is truncated or corrupt"):
        HeaderCache().read("m", too_long)
    os.mkfifo(tmp_path / "fifo.safetensors")
    os.mkfifo(tmp_path / "fifo.bin")  # not parsed, but mergekit's torch.load would wait on it
    os.symlink("/dev/zero", tmp_path / "zero.safetensors")
    os.mkdir(tmp_path / "folder.safetensors")
    for name in ("fifo.safetensors", "fifo.bin", "zero.safetensors", "folder.safetensors"):
        file = str(tmp_path / name)
        with pytest.raises(InputError, match=rf"^m: cannot read {file} \(it is not a regular file\); put the model's"):
            HeaderCache().read("m", file)
    pointer = tmp_path / "lfs.safetensors"
    pointer.write_text(f"version https://git-lfs.github.com/spec/v1\noid sha256:{'0' * 64}\nsize 1234\n")
    with pytest.raises(InputError, match=r"lfs\.safetensors is a git-LFS pointer, not the weights: run `git lfs pull`"):
        HeaderCache().read("m", str(pointer))


def test_cache_key_follows_what_the_counts_depend_on(tmp_path) -> None:
    base = write(str(tmp_path / "base.safetensors"), w=torch.zeros(2, 3))
    agent = write(str(tmp_path / "a.safetensors"), w=torch.ones(2, 3))
    tensor = planned("w", TensorInput("base", base, "w"), TensorInput("a", agent, "w"))
    key = cache.cache_key([tensor])
    assert cache.cache_key([tensor]) == key
    other_epsilon = PlannedTensor(**{**tensor.__dict__, "epsilon": 1e-3})
    assert cache.cache_key([other_epsilon]) != key
    assert cache.cache_key([PlannedTensor(**{**tensor.__dict__, "graph": "another slice"})]) != key

    settings = cache.CacheSettings("on", str(tmp_path / "cache"))
    counts = TensorCounts(name="w", numel=6, epsilon=1e-5, models=("a",), histograms=((6,),))
    headers = HeaderCache()
    with cache.opened(settings, [tensor]) as entry:
        assert entry is not None
        entry.store([counts])
        assert entry.load([tensor], headers) == [counts]
    path = os.path.join(str(tmp_path / "cache"), "prepass", f"{key}.json")
    tensors = [{**counts_to_dict(counts), "numel": 7}]
    with open(path, "w", encoding="utf-8") as handle:
        json.dump({"tensors": tensors, "sha256": cache.checksum(tensors)}, handle)
    with cache.opened(settings, [tensor]) as entry:
        assert entry is not None and entry.load([tensor], headers) is None  # 7 elements where the header says 6


def test_cache_key_follows_the_file_each_input_is_read_from(tmp_path) -> None:
    """Two shards that both hold ``w``: which one a model's index names decides the counts."""
    base = write(str(tmp_path / "base.safetensors"), w=torch.zeros(2, 3))
    first = write(str(tmp_path / "a-1.safetensors"), w=torch.ones(2, 3))
    second = write(str(tmp_path / "a-2.safetensors"), w=torch.full((2, 3), 2.0))
    one = planned("w", TensorInput("base", base, "w"), TensorInput("a", first, "w"), TensorInput("b", second, "w"))
    swapped = PlannedTensor(
        **{**one.__dict__, "inputs": (one.inputs[0], TensorInput("a", second, "w"), TensorInput("b", first, "w"))}
    )
    keys = {cache.cache_key([swapped]), cache.cache_key([one])}  # the same files, read for other models
    index = tmp_path / "model.safetensors.index.json"  # the index the folder is read through
    for weight_map in ({"w": "a-1.safetensors"}, {"w": "a-2.safetensors"}):
        index.write_text(json.dumps({"weight_map": weight_map}), encoding="utf-8")
        keys.add(cache.cache_key([one]))
    assert len(keys) == 4


@pytest.mark.parametrize(
    ("name", "meant"),
    [
        ("ram_pluss", "ram_plus"),
        ("ramplus", "ram_plus"),
        ("RAM+", "ram_plus"),
        ("ram-plus", "ram_plus"),
        ("rma", "ram"),
    ],
)
def test_a_misspelt_method_name_is_recognised(name: str, meant: str) -> None:
    assert close_method(name) == meant


def test_names_far_from_ours_have_no_suggestion() -> None:
    """Names far from every method of ours, or ours exactly, have no suggestion (mergekit's own methods
    near ours, ``ties``, ``ramplus_tl``, are never refused: tests/test_cli.py)."""
    assert [close_method(name) for name in ("ram", "ram_plus", "ram_unique", "linear", "slerp")] == [None] * 5
    assert close_method("ram_uniqe") == "ram_unique"


def test_a_cuda_device_that_is_not_there_names_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    from mergekit_ram.device import check_device

    check_device("cpu", "--device cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    check_device("cuda:1", "--device cuda:1")
    with pytest.raises(DeviceError) as refused:
        check_device("cuda:2", "--device cuda:2")
    assert str(refused.value) == (
        "--device cuda:2 was given but only 2 CUDA device(s) are visible (cuda:0 to cuda:1): "
        "name one of those, or drop --device cuda:2 to run on the CPU"
    )
