"""The agents experiment end to end at tiny size: base, GRPO agents, mergekit-yaml merges, evaluation, report."""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import pytest
import torch

from benchmarks.agents import merges, tokenizer
from benchmarks.agents.analysis import random_subset, region_controls
from benchmarks.agents.evaluate import EvalConfig, eval_sets
from benchmarks.agents.model import ModelSize, completion_text, greedy_correct, new_model, sample, save_model
from benchmarks.agents.run import main
from benchmarks.agents.tasks import TASKS, Problem, sample_problems, split_of
from benchmarks.common import REPO_ROOT, plugin_checkout
from tests.conftest import run_script


def test_saved_tokenizer_gives_the_training_ids():
    text = 'weather in paris in celsius=get_weather(city="Paris",unit="C") rev abc=cba 47+58=105'
    assert tokenizer.hf_tokenizer()(text, add_special_tokens=False)["input_ids"] == tokenizer.encode(text)


def test_held_out_problems_never_appear_in_training():
    for task in TASKS:
        train = {p.prompt for p in sample_problems(task, "train", 300, 0)}
        test = {p.prompt for p in sample_problems(task, "test", 50, 0, unique=True)}
        assert not train & test and all(split_of(prompt) == "test" for prompt in test)


def test_teacher_forced_check_is_greedy_decoding():
    model = new_model(ModelSize(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2), 0)
    model.eval()
    with torch.no_grad():  # make </s> likely, so that greedy completions end
        model.lm_head.bias = None
        model.lm_head.weight[tokenizer.EOS_ID] = model.model.norm.weight * 3.0
    problems = sample_problems("add", "val", 8, 0) + sample_problems("tool", "val", 8, 0)
    completions = sample(model, [tokenizer.encode(p.prompt) for p in problems], 12, greedy=True)
    ended = [(p, c) for p, c in zip(problems, completions) if tokenizer.EOS_ID in c]
    assert ended
    own = [Problem(p.task, p.prompt, completion_text(c)) for p, c in ended]
    assert greedy_correct(model, own).all()
    wrong = [Problem(p.task, p.prompt, completion_text(c) + "0") for p, c in ended]
    assert not greedy_correct(model, wrong).any()


def run_forked(
    argv: Sequence[str], *, env: Mapping[str, str], log_path: Path, data_limit_bytes: Optional[int] = None
) -> dict[str, Any]:
    """``benchmarks.common.run_measured`` for the smoke run, which measures nothing: the real ``mergekit-yaml``'s
    command in this process (``run_script``), its output in ``log_path``."""
    assert data_limit_bytes is None
    started = time.perf_counter()
    changed = {key: value for key, value in env.items() if os.environ.get(key) != value}
    completed = run_script(os.path.basename(argv[0]), *argv[1:], env=changed, check=False)
    log_path.write_text(completed.stdout + completed.stderr, encoding="utf-8")
    return {"returncode": completed.returncode, "wall_s": time.perf_counter() - started, "log_tail": completed.stderr}


@pytest.mark.process  # the pipeline asks a child interpreter which mergekit_ram it imports (benchmarks.common)
def test_smoke_pipeline(tmp_path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(merges, "run_measured", run_forked)
    out, cache, doc = tmp_path / "results", tmp_path / "cache", tmp_path / "quality.md"
    assert main(["--smoke", "--workers", "1", "--out", str(out), "--cache", str(cache), "--doc", str(doc)]) == 0
    results = json.loads((out / "results.json").read_text())
    assert list(results["regimes"]) == ["dense", "sparse"]  # both regimes of agents from one base
    for name, regime in results["regimes"].items():
        ram_plus = [m for m in regime["merges"] if m["setting"]["method"] == "ram_plus"]
        assert ram_plus and set(ram_plus[0]["ram_statistics"]["models"]) == set(TASKS)
        for record in regime["merges"]:
            assert set(record["scores"]["test"]) == {*TASKS, "avg"}
        assert any(m["setting"]["method"] == "ram_ties" for m in regime["merges"])
        # Figure 3's arms: per-agent scales reach the plugin (its statistics report each scale as lambda)
        (unique,) = [m for m in regime["merges"] if m["setting"]["name"] == "unique-add-s1"]
        lambdas = {task: c["lambda"] for task, c in unique["ram_statistics"]["models"].items()}
        assert lambdas == dict(add=1.0, rev=0.0, tool=0.0)
        assert set(regime["checkpoint_scores"]) == {"base", *(f"step{s}/{t}" for s in (2, 4) for t in TASKS)}
        # Figure 3's control: the unique region, random subsets of the agent's changes as large, the shared region
        # (at toy size the agents may change nothing: a base that never answers right gets no advantage)
        controls = regime["analysis"]["step4"]["controls"]
        for task in TASKS:
            arms = controls[task]
            assert arms["random"]["elements"] == arms["unique"]["elements"]
            assert arms["unique"]["elements"] + arms["shared"]["elements"] == arms["changed"]
            assert len(arms["random"]["accuracies"]) == 3
        assert (tmp_path / "img" / f"agents_quality{'' if name == 'dense' else '_' + name}.png").exists()
        assert (out / f"grid{'' if name == 'dense' else '_' + name}.md").exists()
    sparse, dense = (results["regimes"][name]["config"]["grpo"] for name in ("sparse", "dense"))
    assert sparse["lr"] < dense["lr"]
    text = doc.read_text()
    parts = ("ram_plus", "ram_ties", "Figure 3", "random subset", "Sparse agents", "python -m benchmarks.agents.run")
    assert all(part in text for part in parts)
    before = (out / "results.json").read_text()
    assert main(["--smoke", "--workers", "1", "--out", str(out), "--cache", str(cache)]) == 0  # served from the cache
    after = json.loads((out / "results.json").read_text())
    assert all(after["regimes"][n]["merges"] == json.loads(before)["regimes"][n]["merges"] for n in after["regimes"])
    # one regime alone reuses the shared base and that regime's cache
    assert main(["--smoke", "--workers", "1", "--out", str(out), "--cache", str(cache), "--regimes", "sparse"]) == 0
    alone = json.loads((out / "results.json").read_text())
    assert list(alone["regimes"]) == ["sparse"] and alone["regimes"]["sparse"] == after["regimes"]["sparse"]


def test_random_subset_of_an_agents_changes_has_the_size_asked():
    mask = torch.zeros(1000, dtype=torch.bool)
    mask[torch.arange(0, 1000, 3)] = True  # 334 changed elements
    subsets = [random_subset(mask, 50, seed) for seed in (0, 1)]
    for subset in subsets:
        assert int(subset.sum()) == 50 and not (subset & ~mask).any()  # drawn from the changed elements only
    assert not torch.equal(subsets[0], subsets[1]) and torch.equal(subsets[0], random_subset(mask, 50, 0))


def test_region_controls_split_each_agents_changes_into_unique_and_shared(tmp_path):
    # agents whose changed elements are known: add and rev share 10 elements, each has its own 20 and 30
    size = ModelSize(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2)
    base = new_model(size, 0)
    save_model(base, str(tmp_path / "base"), torch.bfloat16)
    changed = {"add": [*range(10), *range(10, 30)], "rev": [*range(10), *range(30, 60)], "tool": []}
    for task, elements in changed.items():
        agent = new_model(size, 0)
        with torch.no_grad():
            agent.lm_head.weight.view(-1)[elements] += 0.5
        save_model(agent, str(tmp_path / task), torch.bfloat16)
    sets = eval_sets(EvalConfig(val=4, test=4))
    controls = region_controls(str(tmp_path / "base"), {t: str(tmp_path / t) for t in TASKS}, sets, 8)
    sizes = {t: (c["changed"], c["unique"]["elements"], c["shared"]["elements"]) for t, c in controls.items()}
    assert sizes == {"add": (30, 20, 10), "rev": (40, 30, 10), "tool": (0, 0, 0)}
    assert controls["add"]["random"]["elements"] == 20 and len(controls["add"]["random"]["accuracies"]) == 3


def test_a_plugin_checkout_without_the_package_is_refused(tmp_path: Path) -> None:
    """``--plugin`` naming a folder without ``mergekit_ram/`` would measure the editable install instead."""
    with pytest.raises(argparse.ArgumentTypeError, match="no mergekit_ram/ there"):
        plugin_checkout(str(tmp_path))
    assert plugin_checkout(str(REPO_ROOT)) == REPO_ROOT
