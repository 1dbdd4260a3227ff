"""Bad input fails clearly and writes nothing; faults leave no finished-looking output.

Every case in CASES runs a real merge (mergekit's ``run_merge``, the plugin registered as
users get it) and checks the message and that no weight file reached the output folder.
``docs/reliability.md`` shows the same table; ``test_reliability_doc_matches`` fails when
they drift (``UPDATE_RELIABILITY_DOC=1`` rewrites the doc's table from the cases).
"""

from __future__ import annotations

import contextlib
import glob
import json
import logging
import os
import re
import shutil
from dataclasses import dataclass
from typing import Any, Callable, Optional

import click
import pytest
import torch
import yaml
from mergekit.scripts.merge_raw_pytorch import main as mergekit_pytorch
from safetensors.torch import load_file, save_file

from mergekit_ram import cli
from mergekit_ram.errors import InputError
from mergekit_ram.synthetic import build_base, tiny_config
from tests.conftest import (
    Merged,
    ModelSet,
    command_refusal,
    load_statistics,
    merge_in_process,
    mergekit_alone,
    run_process,
    run_script,
    script,
    write_recipe,
)
from tests.test_cli import one_line_error

DOC = os.path.join(os.path.dirname(__file__), os.pardir, "docs", "reliability.md")


@dataclass(frozen=True)
class Case:
    """A bad input: how to make it from good models, and what the user is told."""

    title: str
    make: Callable[[ModelSet, str], dict[str, Any]]  # (good models, scratch dir) -> recipe
    expected: str  # a part of the message that must appear
    script: str = "run_merge"  # or "mergekit-pytorch", which merges every tensor of the files
    out: Optional[Callable[[ModelSet, str], str]] = None  # the output folder; default <dir>/out


def _copy(path: str, root: str, name: str) -> str:
    target = os.path.join(root, name)
    shutil.copytree(path, target)
    return target


def _rewrite(path: str, change: Callable[[dict[str, torch.Tensor]], None]) -> None:
    file = os.path.join(path, "model.safetensors")
    state = load_file(file)
    change(state)
    save_file(state, file, metadata={"format": "pt"})


def _no_base(models: ModelSet, root: str) -> dict[str, Any]:
    recipe = models.recipe("ram_plus")
    del recipe["base_model"]
    return recipe


def _base_as_finetune(models: ModelSet, root: str) -> dict[str, Any]:
    recipe = models.recipe("ram_plus")
    recipe["models"].insert(0, {"model": models.base})
    return recipe


def _vocabulary_mismatch(models: ModelSet, root: str) -> dict[str, Any]:
    agent = _copy(models.agents[1], root, "tool-agent-big-vocab")

    def grow(state: dict[str, torch.Tensor]) -> None:
        for name in ("model.embed_tokens.weight", "lm_head.weight"):
            state[name] = torch.cat([state[name], state[name][:4]])

    _rewrite(agent, grow)
    recipe = models.recipe("ram_plus")
    recipe["models"][1] = {"model": agent}
    return recipe


def _other_model(architecture: str = "llama", **sizes: int) -> Callable[[ModelSet, str], dict[str, Any]]:
    """The tool agent replaced by a model of its own (not a fine-tune of the base) with these sizes."""

    def make(models: ModelSet, root: str) -> dict[str, Any]:
        shape = {"hidden_size": 32, "intermediate_size": 48, "num_layers": 2, "vocab_size": 64, **sizes}
        build_base(os.path.join(root, "other-model"), tiny_config(architecture, **shape), seed=5)
        recipe = models.recipe("ram_plus")
        recipe["models"][1] = {"model": os.path.join(root, "other-model")}
        return recipe

    return make


def _missing_tensor(models: ModelSet, root: str) -> dict[str, Any]:
    agent = _copy(models.agents[2], root, "memory-agent-pruned")
    _rewrite(agent, lambda state: state.pop("model.layers.1.mlp.down_proj.weight"))
    recipe = models.recipe("ram")
    recipe["models"][2] = {"model": agent}
    return recipe


def _poison(method: str, value: float) -> Callable[[ModelSet, str], dict[str, Any]]:
    def make(models: ModelSet, root: str) -> dict[str, Any]:
        agent = _copy(models.agents[0], root, "coding-agent-poisoned")

        def poison(state: dict[str, torch.Tensor]) -> None:
            state["model.layers.1.self_attn.v_proj.weight"][3, 5] = value

        _rewrite(agent, poison)
        recipe = models.recipe(method)
        recipe["models"][0] = {"model": agent}
        return recipe

    return make


def _with_parameters(**parameters: Any) -> Callable[[ModelSet, str], dict[str, Any]]:
    return lambda models, root: models.recipe("ram_plus", parameters=parameters)


def _missing_path(models: ModelSet, root: str) -> dict[str, Any]:
    recipe = models.recipe("ram_plus")
    recipe["models"][1] = {"model": os.path.join(root, "no-such-agent")}
    return recipe


def _relative_missing_path(models: ModelSet, root: str) -> dict[str, Any]:
    recipe = models.recipe("ram_plus")
    recipe["models"][1] = {"model": "./no-such-agent"}
    return recipe


def _adapter_folder(as_model: bool) -> Callable[[ModelSet, str], dict[str, Any]]:
    """A LoRA adapter's folder (an RL agent trained with LoRA) given as a model, or as ``agent+adapter`` without
    a folder to merge it in (``--lora-merge-cache``)."""

    def make(models: ModelSet, root: str) -> dict[str, Any]:
        adapter = os.path.join(root, "coding-adapter")
        os.makedirs(adapter, exist_ok=True)
        with open(os.path.join(adapter, "adapter_config.json"), "w", encoding="utf-8") as handle:
            json.dump({"peft_type": "LORA", "base_model_name_or_path": models.base, "r": 8}, handle)
        recipe = models.recipe("ram_plus")
        recipe["models"][0] = {"model": adapter if as_model else f"{models.agents[0]}+{adapter}"}
        return recipe

    return make


def _truncated(models: ModelSet, root: str) -> dict[str, Any]:
    agent = _copy(models.agents[1], root, "tool-agent-truncated")
    file = os.path.join(agent, "model.safetensors")
    with open(file, "rb") as handle:
        data = handle.read()
    with open(file, "wb") as handle:
        handle.write(data[: len(data) // 2])
    recipe = models.recipe("ram")
    recipe["models"][1] = {"model": agent}
    return recipe


def _indexed(change: Callable[[str, dict[str, str]], str]) -> Callable[[ModelSet, str], dict[str, Any]]:
    """The tool agent with a model.safetensors.index.json, its text made by ``change(folder, weight_map)``."""

    def make(models: ModelSet, root: str) -> dict[str, Any]:
        agent = _copy(models.agents[1], root, "tool-agent-indexed")
        weight_map = {name: "model.safetensors" for name in load_file(os.path.join(agent, "model.safetensors"))}
        with open(os.path.join(agent, "model.safetensors.index.json"), "w", encoding="utf-8") as handle:
            handle.write(change(agent, weight_map))
        recipe = models.recipe("ram_plus")
        recipe["models"][1] = {"model": agent}
        return recipe

    return make


def _outside(agent: str, weight_map: dict[str, str]) -> str:
    weight_map["lm_head.weight"] = "../tool-agent-copy/model.safetensors"
    shutil.copytree(agent, os.path.join(os.path.dirname(agent), "tool-agent-copy"))
    return json.dumps({"weight_map": weight_map})


def _lfs_pointer(models: ModelSet, root: str) -> dict[str, Any]:
    """The tool agent cloned without git-lfs: its weights are a pointer file."""
    agent = _copy(models.agents[1], root, "tool-agent-lfs")
    with open(os.path.join(agent, "model.safetensors"), "w", encoding="utf-8") as handle:
        handle.write(f"version https://git-lfs.github.com/spec/v1\noid sha256:{'0' * 64}\nsize 41344\n")
    recipe = models.recipe("ram_plus")
    recipe["models"][1] = {"model": agent}
    return recipe


def _integer_buffers(differ: bool) -> Callable[[ModelSet, str], dict[str, Any]]:
    def make(models: ModelSet, root: str) -> dict[str, Any]:
        paths = []
        for index, path in enumerate([models.base, *models.agents]):
            copy = _copy(path, root, f"buffered-{index}")
            value = 7 + (index if differ else 0)
            _rewrite(copy, lambda state, v=value: state.update({"model.step_counter": torch.tensor([v, 1, 2])}))
            paths.append(copy)
        return {
            "merge_method": "ram_plus",
            "base_model": paths[0],
            "models": [{"model": path} for path in paths[1:]],
        }

    return make


def _base_folder_spelled_with_dots(models: ModelSet, root: str) -> str:
    return os.path.join(models.base, os.pardir, os.path.basename(models.base)) + os.sep


def _finetune_folder_through_a_link(models: ModelSet, root: str) -> str:
    link = os.path.join(root, "link")
    os.symlink(models.agents[0], link)
    return link


def _inside_the_tokenizer_source(models: ModelSet, root: str) -> str:
    return os.path.join(_copy(models.agents[0], root, "donor"), "merged")


CASES = [
    Case("no `base_model`", _no_base, "ram_plus needs `base_model`"),
    Case("the base also listed as a fine-tune", _base_as_finetune, "is also listed under `models`"),
    Case(
        "a tensor's shape differs (vocabularies differ, no `tokenizer_source`)",
        _vocabulary_mismatch,
        "set `tokenizer_source`",
    ),
    Case(
        "a model of another depth (3 layers, the base 2)",
        _other_model(num_layers=3),
        "<dir>/other-model has 3 layers but the base model <models>/base has 2 (`num_hidden_layers`",
    ),
    Case(
        "a model of another architecture (Qwen2, the base Llama)",
        _other_model("qwen2"),
        "<dir>/other-model is a Qwen2ForCausalLM but the base model <models>/base is a LlamaForCausalLM",
    ),
    Case(
        "a model of another width (hidden size 48, the base 32; vocabularies equal)",
        _other_model(hidden_size=48),
        "tensor lm_head.weight has shape [64, 48] in <dir>/other-model but [64, 32] in the base model <models>/base",
    ),
    Case("a tensor missing from one model", _missing_tensor, "has no tensor for model.layers.1.mlp.down_proj.weight"),
    Case("NaN in an input tensor (`ram_plus`: found by the pre-pass)", _poison("ram_plus", float("nan")), "NaN or Inf"),
    Case("Inf in an input tensor (`ram`: found during the merge)", _poison("ram", float("inf")), "NaN or Inf"),
    Case(
        "NaN found during a `mergekit-pytorch` merge (`ram`)",
        _poison("ram", float("nan")),
        "NaN or Inf",
        script="mergekit-pytorch",
    ),
    Case("a negative parameter", _with_parameters(alpha=-1), "parameter 'alpha' in parameters must be"),
    Case("an unknown rescaling rule", _with_parameters(rule="tanh"), "parameter 'rule' in parameters must be"),
    Case("a misspelled parameter name", _with_parameters(apha=2.0), "unknown parameter 'apha'"),
    Case("a model path that does not exist", _missing_path, "does not exist"),
    Case(
        "a relative model path that does not exist",
        _relative_missing_path,
        "model path ./no-such-agent does not exist (relative to <cwd>, the folder the command runs in)",
    ),
    Case(
        "a LoRA adapter's folder given as a model",
        _adapter_folder(as_model=True),
        "<dir>/coding-adapter is a LoRA adapter (adapter_config.json, no config.json), not a model: give it as "
        "`model: <models>/base+<dir>/coding-adapter` (its base, then +, then the adapter) and run with "
        "--lora-merge-cache DIR",
    ),
    Case(
        "a fine-tune with an adapter (`agent+adapter`) and no `--lora-merge-cache`",
        _adapter_folder(as_model=False),
        "which mergekit does in a folder of yours: give --lora-merge-cache DIR",
    ),
    Case("a truncated safetensors file", _truncated, "the file is truncated or corrupt"),
    Case("weights that are a git-LFS pointer (cloned without git-lfs)", _lfs_pointer, "run `git lfs pull`"),
    Case(
        "a truncated model.safetensors.index.json",
        _indexed(lambda agent, weight_map: json.dumps({"weight_map": weight_map})[:200]),
        "cannot use its index",
    ),
    Case(
        "an index naming a file outside the model's folder (`../`)",
        _indexed(_outside),
        "which is not a file in the model's folder",
    ),
    Case(
        "integer buffers that differ between models (`mergekit-pytorch`, which merges every tensor)",
        _integer_buffers(differ=True),
        "Non-floating buffer 'model.step_counter' differs between inputs",
        script="mergekit-pytorch",
    ),
    Case(
        "the output folder is the base's folder (spelled `<models>/base/../base/`)",
        lambda models, root: models.recipe("ram_plus"),
        "is the folder of the input",
        out=_base_folder_spelled_with_dots,
    ),
    Case(
        "`mergekit-pytorch` into the folder of an input file (through a symbolic link)",
        lambda models, root: models.recipe("ram"),
        "is the folder of the input",
        script="mergekit-pytorch",
        out=_finetune_folder_through_a_link,
    ),
    Case(
        "the output folder inside the folder of the `tokenizer_source` model",
        lambda models, root: models.recipe("ram_plus", tokenizer_source=os.path.join(root, "donor")),
        "the merge would write into that input",
        out=_inside_the_tokenizer_source,
    ),
]


_OUTCOMES: dict[str, tuple[str, list[str]]] = {}


def _contents(folder: str) -> dict[str, bytes]:
    """The files directly in ``folder`` ({} if it does not exist)."""
    if not os.path.isdir(folder):
        return {}
    found = {}
    for name in os.listdir(folder):
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            with open(path, "rb") as handle:
                found[name] = handle.read()
        else:
            found[name] = b"<folder>"
    return found


def _outcome(title: str, models: ModelSet, root: str) -> tuple[str, list[str]]:
    """The message a user gets for a case, and the files the merge changed in the output folder (run once)."""
    if title not in _OUTCOMES:
        _OUTCOMES[title] = _run_case(title, models, root)
    return _OUTCOMES[title]


def _run_case(title: str, models: ModelSet, root: str) -> tuple[str, list[str]]:
    case = next(case for case in CASES if case.title == title)
    scratch = os.path.join(root, re.sub(r"\W+", "-", title))
    os.makedirs(scratch)
    out = case.out(models, scratch) if case.out is not None else os.path.join(scratch, "out")
    recipe = case.make(models, scratch)
    before = _contents(out)
    if case.script == "mergekit-pytorch":
        message = _pytorch_error(recipe, scratch, out)
    else:
        try:
            merge_in_process(recipe, out)
        except Exception as error:  # the point: every case raises
            message = str(error).splitlines()[0]
        else:
            raise AssertionError(f"{title}: the merge succeeded")
    after = _contents(out)
    changed = sorted(name for name in {*before, *after} if before.get(name) != after.get(name))
    placeholders = {scratch: "<dir>", os.path.dirname(models.base): "<models>", os.getcwd(): "<cwd>"}
    for path, placeholder in placeholders.items():
        message = message.replace(path, placeholder)
    return message, changed


def _pytorch_error(recipe: dict[str, Any], scratch: str, out: str) -> str:
    """mergekit-pytorch reads files: point the recipe at them; the error line its command prints
    (run in-process; the one-line output itself: tests/test_cli.py)."""
    recipe = {
        **recipe,
        "base_model": os.path.join(recipe["base_model"], "model.safetensors"),
        "models": [{"model": os.path.join(entry["model"], "model.safetensors")} for entry in recipe["models"]],
    }
    try:
        mergekit_pytorch.main(args=[write_recipe(os.path.join(scratch, "r.yml"), recipe), out], standalone_mode=False)
    except click.ClickException as error:  # what the command prints after "Error: "
        return error.format_message()
    except ValueError as error:  # mergekit's own refusal: the last line of the traceback it prints
        return str(error).splitlines()[0]
    raise AssertionError("the merge succeeded")


@pytest.fixture(scope="module")
def scratch_root(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("reliability"))


@pytest.mark.parametrize("case", CASES, ids=[case.title for case in CASES])
def test_bad_input_is_refused_and_nothing_is_written(case: Case, bf16_models: ModelSet, scratch_root: str) -> None:
    message, changed = _outcome(case.title, bf16_models, scratch_root)
    assert case.expected in message
    assert changed == [], f"the failed merge changed {changed} in the output folder"
    if "vocabularies equal" in case.title:
        assert message.endswith(case.expected)  # no hint about vocabulary sizes


def test_models_that_do_not_fit_the_base_are_refused_by_the_probe_alike(
    bf16_models: ModelSet, scratch_root: str, tmp_path
) -> None:
    """The probe gives the merge's line (the same check, before anything is read)."""
    for case in CASES:
        if case.title.startswith(("a model of another depth", "a model of another architecture")):
            message, _ = _outcome(case.title, bf16_models, scratch_root)
            recipe = write_recipe(str(tmp_path / "r.yml"), case.make(bf16_models, str(tmp_path)))
            refused = command_refusal(cli.probe, recipe).replace(str(tmp_path), "<dir>")
            assert refused.replace(os.path.dirname(bf16_models.base), "<models>") == message
            shutil.rmtree(tmp_path / "other-model")


def test_a_model_that_does_not_fit_is_refused_before_anything_is_written(
    bf16_models: ModelSet, tmp_path, caplog: pytest.LogCaptureFixture
) -> None:
    """Before the output folder is made: no folder to remove afterwards, and no ERROR line before the
    one-line error (a shape difference was found only once the merge was planned)."""
    recipe = _other_model(hidden_size=48)(bf16_models, str(tmp_path))
    with caplog.at_level(logging.INFO), pytest.raises(InputError, match="in the base model"):
        merge_in_process(recipe, str(tmp_path / "new" / "out"))
    assert not os.path.exists(tmp_path / "new")
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR or "removed" in r.getMessage()] == []


def test_allow_crimes_keeps_mergekits_own_behaviour(bf16_models: ModelSet, tmp_path, capsys) -> None:
    """A fine-tune whose config.json names an architecture mergekit defines apart (Mistral; its tensors
    are Llama's): one line naming both, or, with --allow-crimes, what mergekit does (merge, probe)."""
    renamed = _copy(bf16_models.agents[1], str(tmp_path), "renamed")
    with open(os.path.join(renamed, "config.json"), encoding="utf-8") as handle:
        config = json.load(handle)
    with open(os.path.join(renamed, "config.json"), "w", encoding="utf-8") as handle:
        json.dump({**config, "architectures": ["MistralForCausalLM"], "model_type": "mistral"}, handle)
    recipe = bf16_models.recipe("ram_plus")
    recipe["models"][1] = {"model": renamed}
    path = write_recipe(str(tmp_path / "r.yml"), recipe)
    with pytest.raises(InputError, match=f"^{renamed} is a MistralForCausalLM but the base model .* LlamaForCausalLM"):
        merge_in_process(path, str(tmp_path / "out"))
    assert not os.path.exists(tmp_path / "out")
    merge_in_process(path, str(tmp_path / "out"), allow_crimes=True)
    assert [m["model"] for m in load_statistics(str(tmp_path / "out"))["models"]][1] == renamed
    cli.probe.main(args=[path, "--allow-crimes", "--json"], standalone_mode=False)
    assert json.loads(capsys.readouterr().out)["models"][1]["model"] == renamed


def _table(models: ModelSet, root: str) -> str:
    rows = ["| bad input | what the user gets |", "|---|---|"]
    for case in CASES:
        message, _ = _outcome(case.title, models, root)
        rows.append(f"| {case.title} | `` {message} `` |")
    return "\n".join(rows)


def test_reliability_doc_matches(bf16_models: ModelSet, scratch_root: str) -> None:
    table = _table(bf16_models, scratch_root)
    with open(DOC, encoding="utf-8") as handle:
        doc = handle.read()
    start = doc.index("<!-- cases:start -->\n") + len("<!-- cases:start -->\n")
    end = doc.index("\n<!-- cases:end -->")
    current = doc[start:end]
    if os.environ.get("UPDATE_RELIABILITY_DOC"):
        with open(DOC, "w", encoding="utf-8") as handle:
            handle.write(doc[:start] + table + doc[end:])
        return
    assert current == table, "docs/reliability.md is out of date: rerun with UPDATE_RELIABILITY_DOC=1"


def test_identical_integer_buffers_are_copied(bf16_models: ModelSet, tmp_path) -> None:
    recipe = _integer_buffers(differ=False)(bf16_models, str(tmp_path))
    recipe["base_model"] = os.path.join(recipe["base_model"], "model.safetensors")
    recipe["models"] = [{"model": os.path.join(entry["model"], "model.safetensors")} for entry in recipe["models"]]
    out = str(tmp_path / "out")
    mergekit_pytorch.main(args=[write_recipe(str(tmp_path / "r.yml"), recipe), out], standalone_mode=False)
    merged = load_file(os.path.join(out, "model.safetensors"))
    assert torch.equal(merged["model.step_counter"], torch.tensor([7, 1, 2]))


@pytest.mark.parametrize("kind", ["one equal to the base", "all identical"])
def test_degenerate_finetunes_merge_without_nan(bf16_models: ModelSet, tmp_path, kind: str) -> None:
    agents = [bf16_models.base, *bf16_models.agents[1:]] if kind == "one equal to the base" else [bf16_models.agents[1]]
    if kind == "all identical":
        agents = agents + [_copy(bf16_models.agents[1], str(tmp_path), "twin")]
    recipe = {"merge_method": "ram_plus", "base_model": _copy(bf16_models.base, str(tmp_path), "base")}
    recipe["models"] = [{"model": path} for path in agents]
    out = str(tmp_path / "out")
    merge_in_process(recipe, out)
    merged = load_file(os.path.join(out, "model.safetensors"))
    assert all(not torch.isnan(tensor).any() for tensor in merged.values())
    statistics = load_statistics(out)
    if kind == "all identical":
        twin = load_file(os.path.join(bf16_models.agents[1], "model.safetensors"))
        assert all(torch.equal(merged[name], tensor) for name, tensor in twin.items())
        assert [m["rho"] for m in statistics["models"]] == ["inf", "inf"]  # nothing unique: rho = inf
        assert [m["lambda"] for m in statistics["models"]] == [1.2, 1.2]  # defined, never used
    else:
        assert statistics["models"][0]["changed"] == 0 and statistics["models"][0]["lambda"] == 1.0
        assert statistics["warnings"] == [
            f"{bf16_models.base} changed no parameter by more than epsilon: is it the base model itself, "
            "or a wrong path?"
        ]


def test_same_inputs_give_byte_identical_files(ram_plus_merge: Merged, tmp_path) -> None:
    """The shared merge (a mergekit-yaml process) against merges of the same recipe in this
    process with one and two torch threads, and in 8K shards."""
    recipe = ram_plus_merge.recipe
    with open(os.path.join(ram_plus_merge.out, "model.safetensors"), "rb") as handle:
        outputs = {"mergekit-yaml": handle.read()}
    threads = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            out = str(tmp_path / f"threads-{count}")
            merge_in_process(recipe, out)
            with open(os.path.join(out, "model.safetensors"), "rb") as handle:
                outputs[f"{count} threads"] = handle.read()
    finally:
        torch.set_num_threads(threads)
    assert len(set(outputs.values())) == 1

    sharded = str(tmp_path / "sharded")
    merge_in_process(recipe, sharded, out_shard_size=8000)
    shards = sorted(glob.glob(os.path.join(sharded, "*.safetensors")))
    assert len(shards) == 7  # 8K shards of the tiny model
    tensors: dict[str, torch.Tensor] = {}
    for shard in shards:
        tensors.update(load_file(shard))
    whole = load_file(os.path.join(ram_plus_merge.out, "model.safetensors"))
    assert set(tensors) == set(whole)
    assert all(torch.equal(tensors[name], tensor) for name, tensor in whole.items())


def _files(folder: str) -> dict[str, bytes]:
    """Every file under ``folder`` (hidden ones included), by path relative to it; the manifest's weights by
    name (their device, inode and mtime identify these very files, so they differ between folders)."""
    found = {}
    for root, _, names in os.walk(folder):
        for name in names:
            with open(os.path.join(root, name), "rb") as handle:
                found[os.path.relpath(os.path.join(root, name), folder)] = handle.read()
    return found


@pytest.mark.process
def test_the_folder_is_byte_identical_whatever_the_hash_seed(bf16_models: ModelSet, tmp_path) -> None:
    """One recipe of six fine-tunes merged by mergekit-yaml under another PYTHONHASHSEED than this
    process's, and in this process: every file equal, the card included (mergekit lists the models in
    it from a set, 720 orders; each output folder is named ``out``, as the card's title is its name)."""
    copies = [_copy(path, str(tmp_path), f"copy-{index}") for index, path in enumerate(bf16_models.agents)]
    recipe = write_recipe(
        str(tmp_path / "r.yml"),
        {**bf16_models.recipe("ram_plus"), "models": [{"model": p} for p in [*bf16_models.agents, *copies]]},
    )
    seed = os.environ.get("PYTHONHASHSEED", "")
    other = str(int(seed) + 1) if seed.isdigit() else "0"  # this process's is random unless the variable is set
    out = str(tmp_path / "a" / "out")  # the hash seed is the interpreter's, taken at its start
    completed = run_process([script("mergekit-yaml"), recipe, out, "--quiet"], {"PYTHONHASHSEED": other})
    assert completed.returncode == 0, completed.stderr[-3000:]
    merge_in_process(recipe, str(tmp_path / "b" / "out"))
    first, second = _files(str(tmp_path / "a" / "out")), _files(str(tmp_path / "b" / "out"))
    assert sorted(first) == sorted(second) and "README.md" in first
    assert [name for name in first if first[name] != second[name]] == []


OTHER_METHODS = {
    "linear": {"weight": 0.25},
    "task_arithmetic": {"weight": 0.5},
    "ties": {"weight": 1.0, "density": 0.5},
}


@pytest.fixture(scope="module")
def other_methods(bf16_models: ModelSet, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Each method of OTHER_METHODS merged by mergekit-multi as a stage of one file, with the plugin
    and as mergekit alone: {"on": stages folder, "off": stages folder}."""
    root = tmp_path_factory.mktemp("other-methods")
    stages = []
    for method, parameters in OTHER_METHODS.items():
        recipe = bf16_models.recipe(method, dtype="bfloat16")
        recipe["models"] = [{**entry, "parameters": parameters} for entry in recipe["models"]]
        if method == "linear":
            del recipe["base_model"]
        stages.append({"name": f"{method}-stage", **recipe})  # a stage named like a method would be its input
    config = str(root / "stages.yml")
    with open(config, "w", encoding="utf-8") as handle:
        yaml.safe_dump_all(stages, handle, sort_keys=False)
    folders = {}
    for name, alone in (("on", False), ("off", True)):
        folders[name] = str(root / name)
        with mergekit_alone() if alone else contextlib.nullcontext():
            run_script("mergekit-multi", config, "--intermediate-dir", folders[name])
    return folders


@pytest.mark.parametrize("method", list(OTHER_METHODS))
def test_other_methods_are_unchanged_by_the_plugin(other_methods: dict[str, str], method: str) -> None:
    files = []
    for name in ("on", "off"):
        out = os.path.join(other_methods[name], f"{method}-stage")
        assert not os.path.exists(os.path.join(out, "ram_statistics.json"))
        with open(os.path.join(out, "model.safetensors"), "rb") as handle:
            files.append(handle.read())
    assert files[0] == files[1]


_NEAR_MAX_TENSOR = "model.layers.1.self_attn.v_proj.weight"


def _near_float32_max(models: ModelSet, root: str, base_value: float, agent_value: float) -> ModelSet:
    """Copies of ``models`` where one element of one tensor is ``base_value`` in the base and in every
    agent but the first (the coding agent), which alone changed it, to ``agent_value``."""
    base = _copy(models.base, root, "base")
    agents = [_copy(path, root, os.path.basename(path)) for path in models.agents]
    for index, path in enumerate([base, *agents]):
        value = agent_value if index == 1 else base_value
        _rewrite(path, lambda state, v=value: state[_NEAR_MAX_TENSOR].__setitem__((3, 5), v))
    return ModelSet(base=base, agents=agents, design=models.design)


@pytest.mark.parametrize(
    ("method", "cause"),
    [
        ("ram", "update"),
        ("ram_plus", "update"),
        ("ram_ties", "update"),
        ("ram_unique", "update"),
        ("ram_plus", "lambda"),
    ],
)
def test_an_overflow_is_one_line_naming_the_tensor_and_the_fix(
    fp32_models: ModelSet, tmp_path, method: str, cause: str
) -> None:
    """Values near the float32 maximum through the real mergekit-yaml: one line naming the tensor and the fix,
    nothing written. ``update``: the coding agent's update (3e38 - (-3e38)) overflows float32 itself,
    whatever lambda (ram_ties: before its trim); ``lambda``: the update (1.3e38) fits, base + lambda * update
    (2e38 + 1.2 * 1.3e38) does not. ``dtype: float64``, the fix the line names, then merges both."""
    values = {"update": (-3e38, 3e38), "lambda": (2e38, 3.3e38)}[cause]
    models = _near_float32_max(fp32_models, str(tmp_path), *values)
    recipe = write_recipe(str(tmp_path / "r.yml"), models.recipe(method))
    completed = run_script("mergekit-yaml", recipe, str(tmp_path / "out"), check=False)
    what = (
        f"the update of {models.agents[0]} (its value minus the base's)" if cause == "update" else "the merged values"
    )
    expected = (
        f"{method}: tensor {_NEAR_MAX_TENSOR}: {what} overflow{'s' if cause == 'update' else ''} float32; merge with "
        "`dtype: float64` (arithmetic is then float64)"
    )
    assert one_line_error(completed) == expected
    assert not os.path.exists(tmp_path / "out")
    merge_in_process(models.recipe(method, dtype="float64"), str(tmp_path / "fixed"))  # the fix the line names
    merged = load_file(os.path.join(tmp_path / "fixed", "model.safetensors"))[_NEAR_MAX_TENSOR]
    lam = 1.2 if method == "ram_plus" else 1.0  # ram_plus's default r
    assert merged[3, 5].item() == pytest.approx(values[0] + lam * (values[1] - values[0]))
