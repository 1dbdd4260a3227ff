"""What RAM sees: the probe, the statistics every merge leaves, the pre-pass cache, warnings."""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import math
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from mergekit.config import MergeConfiguration
from mergekit.options import MergeOptions
from safetensors.torch import load_file, save_file

from mergekit_ram import cache
from mergekit_ram.integration.merge import plan_merge
from mergekit_ram.parameters import ParameterError
from mergekit_ram.probe import probe_config, select_stages
from mergekit_ram.rescaling import Rescaling
from mergekit_ram.stats.arithmetic import build_statistics, by_module, model_lambda, module_of
from mergekit_ram.stats.data import TensorCounts
from mergekit_ram.stats.schema import (
    SCHEMA_VERSION,
    UnreadableStatistics,
    read_statistics,
    statistics_from_dict,
    statistics_to_dict,
    statistics_to_json,
)
from mergekit_ram.synthetic import build_agents, independent_overlap, tiny_config
from tests import reference
from tests.conftest import Merged, ModelSet, load_statistics, load_weights, merge_in_process, run_script, write_recipe


def independent_figures(models: ModelSet, epsilon: float = 1e-5) -> dict[str, Any]:
    """Totals and per-module totals from the reference, straight from the files."""
    base = load_weights(models.base)
    finetunes = [load_weights(path) for path in models.agents]
    totals: dict[str, Any] = {"histograms": [[0, 0, 0] for _ in finetunes], "numel": 0, "modules": {}}
    for name, tensor in base.items():
        counts = reference.counts(tensor, [ft[name] for ft in finetunes], epsilon)
        module = totals["modules"].setdefault(module_of(name), [[0, 0, 0] for _ in finetunes])
        for index, row in enumerate(counts.histograms):
            for k, value in enumerate(row):
                totals["histograms"][index][k] += value
                module[index][k] += value
        totals["numel"] += tensor.numel()
    return totals


def test_probe_figures_equal_an_independent_computation(
    bf16_models: ModelSet, ram_plus_merge: Merged, tmp_path
) -> None:
    recipe = write_recipe(str(tmp_path / "r.yml"), bf16_models.recipe("ram_plus", parameters={"r": 0.15, "alpha": 1.5}))
    png = str(tmp_path / "figure2.png")
    completed = run_script("mergekit-ram", "probe", recipe, "--json", "--by-module", "--plot", png)
    probe = json.loads(completed.stdout)
    expected = independent_figures(bf16_models)

    for index, model in enumerate(probe["models"]):
        histogram = expected["histograms"][index]
        assert [model["overlap_histogram"][str(k)] for k in (1, 2, 3)] == histogram
        assert model["changed"] == sum(histogram)
        assert model["unique"] == histogram[0] and model["shared"] == sum(histogram[1:])
        assert model["density"] == sum(histogram) / expected["numel"]
        rho = reference.rho(sum(histogram[1:]), histogram[0])
        assert model["rho"] == rho
        assert model["lambda"] == reference.lambda_clip(rho, 0.15, 1.5)
    assert set(probe["by_module"]) == set(expected["modules"])
    for module, rows in probe["by_module"].items():
        for index, row in enumerate(rows):
            assert [row["overlap_histogram"][str(k)] for k in (1, 2, 3)] == expected["modules"][module][index]
    with open(png, "rb") as handle:
        assert handle.read(8) == b"\x89PNG\r\n\x1a\n"
    assert os.path.getsize(png) > 20_000

    # The probe and the merge agree: same tensors, same counts (r and alpha change lambda only).
    assert load_statistics(ram_plus_merge.out)["tensors"] == probe["tensors"]


def test_probe_text_output(bf16_models: ModelSet, tmp_path) -> None:
    recipe = write_recipe(str(tmp_path / "r.yml"), bf16_models.recipe("ram"))
    completed = run_script("mergekit-ram", "probe", recipe, "--by-module")
    assert "ram probe of" in completed.stdout
    assert "k=1" in completed.stdout and "k=3" in completed.stdout
    assert "attention" in completed.stdout and "output head" in completed.stdout
    ties = write_recipe(str(tmp_path / "t.yml"), bf16_models.recipe("ties"))
    with pytest.raises(
        ParameterError,
        match=r"^probe reads mergekit-ram recipes \(ram, ram_plus, ram_ties, ram_unique\); this one says "
        "merge_method: ties ",
    ):
        select_stages(ties)  # the command's one-line errors: tests/test_cli.py


def test_every_merge_leaves_its_statistics(bf16_models: ModelSet, ram_plus_merge: Merged) -> None:
    out = ram_plus_merge.out
    statistics = load_statistics(out)
    assert statistics["method"] == "ram_plus"
    assert statistics["parameters"] == {"epsilon": 1e-05, "r": 0.1, "alpha": 2.0, "rule": "clip"}
    assert set(statistics["versions"]) >= {"mergekit-ram", "mergekit"}
    assert statistics["versions"]["mergekit"] == "0.1.5"
    assert [m["model"] for m in statistics["models"]] == bf16_models.agents
    card = open(os.path.join(out, "README.md"), encoding="utf-8").read()
    assert "## RAM statistics" in card
    for model in statistics["models"]:
        assert f"| {model['model']} | {100 * model['density']:.2f}% | {model['changed']:,} |" in card
        assert f"{model['lambda']:.4f}" in card
    # Reproducible from the card: the plugin named, linked, tagged, and how to install it.
    front_matter = yaml.safe_load(card[4 : card.index("\n---\n", 4)])
    assert front_matter["tags"] == ["mergekit", "merge", "mergekit-ram"]
    assert "The `ram_plus` merge method comes from [mergekit-ram](https://github.com/mergekit-ram/mergekit-ram)" in card
    assert (
        "(from a clone of the project: `pip install .`; from a built wheel: `pip install dist/mergekit_ram-*.whl`"
        in card
    )
    assert "Without mergekit-ram, mergekit refuses `ram_plus` (an unknown merge method)" in card
    assert "silently runs its own built-in `ram`" not in card  # that note is for ram only


def test_tables_mark_pins_and_the_cap_and_say_what_the_columns_are(bf16_models: ModelSet, tmp_path) -> None:
    """The table after a merge has the probe's columns and a legend. ram_unique's factor is its recipe's ``scale``:
    the terminal's table, the probe and the card head that column ``scale`` and mark no row (a scale is a setting,
    not a pinned statistic); a pinned lambda of ram_plus is marked, and a lambda at its cap 1 + r * alpha."""
    recipe = bf16_models.recipe("ram_unique")
    recipe["models"][1]["parameters"] = {"scale": 1.5}
    path = write_recipe(str(tmp_path / "unique.yml"), recipe)
    out = str(tmp_path / "out")
    merged = run_script("mergekit-yaml", path, out)
    table = merged.stderr[merged.stderr.index("ram_unique merge written to") :].splitlines()[1:8]
    assert table[0].split() == ["model", "density", "changed", "shared", "unique", "rho", "scale"]
    assert [row.split()[-1] for row in table[2:5]] == ["1.0000", "1.5000", "1.0000"]
    assert (
        table[6]
        == "rho = shared / unique; scale: the recipe's factor of its unique changes (shared positions keep the base)"
    )
    assert "pinned" not in merged.stderr and "cap" not in "".join(table)
    probed = run_script("mergekit-ram", "probe", path).stdout.splitlines()
    header = next(line for line in probed if line.startswith("model "))
    assert header.split() == ["model", "density", "changed", "shared", "unique", "rho", "scale"]
    assert "pinned" not in "\n".join(probed)
    card = open(os.path.join(out, "README.md"), encoding="utf-8").read()
    assert "| model | density | changed | shared | unique | rho | scale |" in card
    assert "pinned" not in card.split("## RAM statistics", 1)[1]
    assert f"| {bf16_models.agents[1]} |" in card and "| 1.5000 |" in card

    pinned = bf16_models.recipe("ram_plus")
    pinned["models"][1]["parameters"] = {"lambda": 1.3}  # the coding agent's rho (about 17) is above alpha
    merged = run_script("mergekit-yaml", write_recipe(str(tmp_path / "pinned.yml"), pinned), str(tmp_path / "p"))
    lines = merged.stderr[merged.stderr.index("ram_plus merge written to") :].splitlines()
    assert lines[1].split() == ["model", "density", "changed", "shared", "unique", "rho", "lambda"]
    assert lines[3].endswith("1.2000 (cap)") and lines[4].endswith("1.3000 (pinned)") and lines[5].endswith(" 1.1074")
    assert lines[7] == (
        "rho = shared / unique; lambda = 1 + r * clip(rho, 0, alpha) scales its unique changes, at most "
        "1 + r * alpha = 1.2000 (cap); (pinned): set in the recipe"
    )
    card = open(os.path.join(str(tmp_path / "p"), "README.md"), encoding="utf-8").read()
    assert "| 1.3000 (lambda pinned) |" in card and "| 1.2000 (cap) |" in card
    assert "rho = shared / unique; lambda = 1 + r * clip(rho, 0, alpha) scales its unique changes" in card


def _planned_key(recipe: dict[str, Any]) -> str:
    return cache.cache_key(plan_merge(MergeConfiguration.model_validate(recipe), MergeOptions(quiet=True)).tensors)


def test_cache_key_changes_when_it_must_and_only_then(bf16_models: ModelSet, tmp_path) -> None:
    models = ModelSet(
        base=shutil.copytree(bf16_models.base, str(tmp_path / "base")),
        agents=[shutil.copytree(path, str(tmp_path / os.path.basename(path))) for path in bf16_models.agents],
        design=bf16_models.design,
    )
    recipe = models.recipe("ram_plus")
    key = _planned_key(recipe)
    # Settings that only turn counts into lambda: the same counts.
    for parameters in ({"r": 0.2}, {"alpha": 0.5}, {"rule": "soft"}):
        assert _planned_key({**recipe, "parameters": parameters}) == key, parameters
    pinned = models.recipe("ram_plus")
    pinned["models"][1]["parameters"] = {"lambda": 1.3}  # the coding agent's rho (about 17) is above alpha
    assert _planned_key(pinned) == key

    # Anything the counts depend on: new counts.
    changed = {
        "epsilon": {**recipe, "parameters": {"epsilon": 1e-4}},
        "epsilon filter": {**recipe, "parameters": {"epsilon": [{"filter": "mlp", "value": 1e-3}, {"value": 1e-5}]}},
        "dtype": {**recipe, "dtype": "float32"},
        "slices": {
            "merge_method": "ram_plus",
            "base_model": models.base,
            "slices": [
                {"sources": [{"model": m, "layer_range": [0, 1]} for m in [*models.agents, models.base]]},
                {"sources": [{"model": m, "layer_range": [0, 1]} for m in [*models.agents, models.base]]},
            ],
        },
        "model order": {**recipe, "models": list(reversed(recipe["models"]))},
    }
    keys = {name: _planned_key(variant) for name, variant in changed.items()}
    assert key not in keys.values()
    assert len(set(keys.values())) == len(keys)

    # A model file rewritten with one element changed (same size).
    file = os.path.join(models.agents[1], "model.safetensors")
    state = load_file(file)
    state["model.norm.weight"][0] += 1.0
    save_file(state, file, metadata={"format": "pt"})
    assert _planned_key(recipe) != key


def test_cache_is_used_for_sweeps_and_never_stale(
    bf16_models: ModelSet, tmp_path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Merges by mergekit's run_merge in this process, the cache set up as a user's shell would."""
    agent = shutil.copytree(bf16_models.agents[0], str(tmp_path / "agent"))
    models = ModelSet(bf16_models.base, [agent, *bf16_models.agents[1:]], bf16_models.design)
    monkeypatch.setenv("MERGEKIT_RAM_CACHE_DIR", str(tmp_path / "cache"))
    caplog.set_level(logging.INFO, logger="mergekit_ram")

    def merge(name: str, parameters: dict[str, Any], cache_mode: str = "on") -> tuple[str, dict[str, Any]]:
        monkeypatch.setenv("MERGEKIT_RAM_CACHE", cache_mode)
        caplog.clear()
        out = str(tmp_path / name)
        merge_in_process(models.recipe("ram_plus", parameters=parameters), out)
        return caplog.text, load_statistics(out)

    log, first = merge("first", {"r": 0.1})
    assert "pre-pass done" in log and "counts cached in" in log
    log, second = merge("second", {"r": 0.2, "rule": "soft"})
    assert "using cached counts" in log and "pre-pass done" not in log
    assert second["tensors"] == first["tensors"]
    assert [m["lambda"] for m in second["models"]] == [
        reference.lambda_soft(reference.rho(m["shared"], m["unique"]), 0.2) for m in first["models"]
    ]
    log, _ = merge("refreshed", {"r": 0.2}, cache_mode="refresh")
    assert "pre-pass done" in log and "using cached counts" not in log
    log, _ = merge("epsilon", {"epsilon": 1e-3})
    assert "pre-pass done" in log

    file = os.path.join(agent, "model.safetensors")
    state = load_file(file)
    state["model.layers.0.mlp.up_proj.weight"] = state["model.layers.0.mlp.up_proj.weight"] * 2
    save_file(state, file, metadata={"format": "pt"})
    # The same path, new contents, read by a new mergekit-yaml process (mergekit keeps the files
    # it has opened for the life of a process).
    recipe = write_recipe(str(tmp_path / "modified.yml"), models.recipe("ram_plus", parameters={"r": 0.1}))
    out = str(tmp_path / "modified")
    log = run_script("mergekit-yaml", recipe, out, "-v", env={"MERGEKIT_RAM_CACHE": "on"}).stderr
    assert "pre-pass done" in log and "using cached counts" not in log
    assert load_statistics(out)["tensors"] != first["tensors"]


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("float16", "float16 checkpoints"),
        ("dense", "RAM's premise of sparse, mostly disjoint updates does not hold"),
        ("unchanged", "changed no parameter by more than epsilon"),
        ("mixed dtypes", "stored in different dtypes"),
        ("identical", "have no unique change at all"),
    ],
)
def test_warnings_that_save_a_wasted_merge(
    tmp_path, caplog: pytest.LogCaptureFixture, case: str, expected: str
) -> None:
    config = tiny_config("llama", hidden_size=32, intermediate_size=48, num_layers=1, vocab_size=64)
    overlap = independent_overlap([0.95, 0.97]) if case == "dense" else {(0,): 0.1, (1,): 0.1}
    dtype = torch.float16 if case == "float16" else torch.bfloat16
    base, agents, _ = build_agents(str(tmp_path / "models"), config, overlap, ["a", "b"], dtype=dtype)
    if case == "unchanged":
        agents[1] = shutil.copytree(base, str(tmp_path / "base-copy"))
    if case == "identical":  # one agent twice, under two paths (one path listed twice is refused)
        agents[1] = shutil.copytree(agents[0], str(tmp_path / "agent-copy"))
        expected = f"{agents[0]}, {agents[1]} {expected} (every parameter each changed, another model changed too"
    if case == "mixed dtypes":
        state = load_file(os.path.join(agents[1], "model.safetensors"))
        save_file({k: v.float() for k, v in state.items()}, os.path.join(agents[1], "model.safetensors"))
    recipe = {"merge_method": "ram_plus", "base_model": base, "models": [{"model": p} for p in agents]}
    out = str(tmp_path / "out")
    if case in ("float16", "identical"):  # through the console scripts: shown without -v, one line each
        path = write_recipe(str(tmp_path / "r.yml"), recipe)
        for completed in (run_script("mergekit-yaml", path, out), run_script("mergekit-ram", "probe", path)):
            assert len([line for line in completed.stderr.splitlines() if expected in line]) == 1
    else:
        caplog.set_level(logging.WARNING)
        merge_in_process(recipe, out)
        assert [r.levelno for r in caplog.records if expected in r.getMessage()] == [logging.WARNING]
        probed = probe_config(MergeConfiguration.model_validate(recipe), MergeOptions(quiet=True))
        assert [warning for warning in probed.warnings if expected in warning]
    assert [warning for warning in load_statistics(out)["warnings"] if expected in warning]


# The arithmetic and the schema on counts built by hand (no merge) ----------------------

#: Model a: unique 2 + 3, shared 10 + 5 (rho 15 / 5 = 3); model b: nothing unique (rho inf).
HAND_COUNTS = (
    TensorCounts("model.layers.0.mlp.up_proj.weight", 100, 1e-5, ("a", "b"), ((2, 10), (0, 10))),
    TensorCounts("model.layers.0.self_attn.q_proj.weight", 50, 1e-5, ("a", "b"), ((3, 5), (0, 5))),
)


def test_lambda_is_decided_once_per_model() -> None:
    paper = Rescaling(0.1, 2.0, "clip")
    assert model_lambda(3.0, paper) == 1.2  # 1 + 0.1 * clip(3, 0, 2)
    assert model_lambda(3.0, paper, ("rho", 0.5)) == 1.05  # the pinned rho: 1 + 0.1 * 0.5
    assert model_lambda(3.0, paper, ("lambda", 1.7)) == 1.7  # a pinned lambda as is
    assert model_lambda(3.0, None) == 1.0  # ram

    statistics = build_statistics("ram_plus", HAND_COUNTS, rescaling=Rescaling(0.1, 5.0, "clip"))
    a, b = statistics.models
    assert (a.numel, a.active, a.unique, a.shared, a.density) == (150, 20, 5, 15, 20 / 150)
    assert (a.rho, a.lambda_, a.pinned) == (3.0, 1.3, None)  # 1 + 0.1 * 3, under alpha = 5
    assert (b.rho, b.lambda_) == (math.inf, 1.5)  # the bound 1 + 0.1 * 5, never applied
    assert statistics.parameters == {"epsilon": 1e-5, "r": 0.1, "alpha": 5.0, "rule": "clip"}

    pinned = build_statistics(
        "ram_plus", HAND_COUNTS, rescaling=Rescaling(), pins={"a": ("rho", 0.5), "c": ("lambda", 1.3)}
    )
    a, b, c = pinned.models
    assert (a.rho, a.measured_rho, a.lambda_, a.pinned) == (0.5, 3.0, 1.05, "rho")
    assert (c.model, c.numel, c.histogram, c.rho, c.lambda_, c.pinned) == ("c", 0, (), 0.0, 1.3, "lambda")

    ram = build_statistics("ram", HAND_COUNTS, rescaling=None)
    assert [stats.lambda_ for stats in ram.models] == [1.0, 1.0]
    assert ram.parameters == {"epsilon": 1e-5}


def test_counts_by_module_keep_rho_local() -> None:
    embeddings = TensorCounts("model.embed_tokens.weight", 10, 1e-5, ("a", "b"), ((1, 0), (0, 0)))
    modules = by_module(build_statistics("ram_plus", (*HAND_COUNTS, embeddings), rescaling=Rescaling()))
    assert list(modules) == ["embeddings", "attention", "mlp"]  # MODULES order, not alphabetical
    assert [(s.model, s.histogram, s.measured_rho) for s in modules["embeddings"]] == [
        ("a", (1, 0), 0.0),
        ("b", (0, 0), 0.0),
    ]
    assert [(s.model, s.histogram, s.measured_rho) for s in modules["attention"]] == [
        ("a", (3, 5), 5 / 3),
        ("b", (0, 5), math.inf),
    ]
    assert [(s.model, s.histogram, s.measured_rho) for s in modules["mlp"]] == [
        ("a", (2, 10), 5.0),
        ("b", (0, 10), math.inf),
    ]


def test_the_json_schema_round_trips() -> None:
    statistics = build_statistics("ram_plus", HAND_COUNTS, rescaling=Rescaling(0.1, 2.0, "soft"))
    text = statistics_to_json(statistics)
    data = json.loads(text)
    assert data["schema"] == SCHEMA_VERSION == 2
    assert [(m["rho"], m["measured_rho"]) for m in data["models"]] == [(3.0, 3.0), ("inf", "inf")]
    assert [m["lambda"] for m in data["models"]] == [1.075, 1.1]  # soft: 1 + 0.1 * 3 / 4; 1 + 0.1
    assert statistics_from_dict(data) == statistics

    probe = statistics_to_dict(statistics, with_modules=True)["by_module"]
    assert [row["local_rho"] for row in probe["mlp"]] == [5.0, "inf"]

    with pytest.raises(ValueError, match=r"\(schema: schema 3; this mergekit-ram reads schema 2 "):
        statistics_from_dict({**data, "schema": 3})
    hand_edited = copy.deepcopy(data)
    hand_edited["models"][1]["rho"] = "Infinity"
    with pytest.raises(ValueError, match=r"\(models.1.rho.float: Input should be a finite number\)"):
        statistics_from_dict(hand_edited)


def test_the_file_keeps_its_bytes() -> None:
    """The golden file holds the bytes the writer before the pydantic models wrote (8842a28) for these statistics:
    a pinned rho, an infinite one, a LoRA reference with a revision, modules, a warning."""
    counts = [
        ("model.layers.0.mlp.up_proj.weight", 100, ((2, 10), (0, 10)), "mlp"),
        ("model.layers.0.self_attn.q_proj.weight", 50, ((3, 5), (0, 5)), "attention"),
    ]
    models = ("/m/a", "/m/b+/m/lora@v1")
    tensors = [TensorCounts(name, numel, 1e-5, models, rows, module) for name, numel, rows, module in counts]
    statistics = build_statistics(
        "ram_plus", tensors, rescaling=Rescaling(0.1, 2.0, "soft"), pins={"/m/a": ("rho", 2.5)}
    )
    versions = {"mergekit-ram": "0.1.0", "mergekit": "0.1.5", "torch": "2.6.0"}
    statistics = dataclasses.replace(statistics, versions=versions, warnings=("/m/a: a warning",))
    golden = (Path(__file__).parent / "ram_statistics.golden").read_text(encoding="utf-8")
    assert statistics_to_json(statistics) == golden
    assert statistics_from_dict(json.loads(golden)) == statistics


def test_a_strangers_number_is_one_line() -> None:
    """Attack group 6: a rho of 1e999 (JSON's way to overflow a float) is refused in one line naming it."""
    text = (Path(__file__).parent / "ram_statistics.golden").read_text(encoding="utf-8")
    with pytest.raises(UnreadableStatistics) as error:
        read_statistics(text.replace('"rho": 2.5', '"rho": 1e999'))
    assert str(error.value) == (
        "ram_statistics.json is not the statistics file a merge writes (models.0.rho.float: Input should be a finite "
        "number)"
    )


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("rule", "tanh", "must be 'clip' (RAM+) or 'soft' (RAM+s); got 'tanh'"),
        ("r", -0.1, "must be a finite number >= 0; got -0.1"),
        ("r", math.nan, "must be a finite number >= 0; got nan"),
        ("r", math.inf, "must be a finite number >= 0; got inf"),
        ("r", True, "must be a finite number >= 0; got True (true/false is a boolean, not a number)"),
        ("alpha", -2.0, "must be a finite number >= 0; got -2.0"),
        ("alpha", None, "must be a finite number >= 0; got None"),
    ],
)
def test_a_statistics_file_is_read_with_the_parameter_tables_rules(name: str, value: object, message: str) -> None:
    """r, alpha and rule have one definition of validity, the parameter table: a statistics file's
    values pass through it too (``Rescaling`` itself checks nothing)."""
    data = statistics_to_dict(build_statistics("ram_plus", HAND_COUNTS, rescaling=Rescaling()))
    data["parameters"][name] = value
    with pytest.raises(ParameterError) as error:
        statistics_from_dict(data)
    assert str(error.value) == f"ram_plus: parameter {name!r} in ram_statistics.json {message}"
