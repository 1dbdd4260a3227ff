"""The merge grid and its recipes, each merge run by the real ``mergekit-yaml``.

Grids follow the paper's Table 11 for the baselines and the issue for RAM / RAM+:

- ``task_arithmetic``: theta = theta_base + lambda * sum_t tau_t, lambda in SCALES.
- ``ties``: trim to the top ``density`` of each tau_t by magnitude, elect signs, disjoint
  mean, times lambda; density in (0.1, 0.2, 0.3) x lambda in SCALES.
- ``dare_linear`` / ``dare_ties``: drop a share p of each tau_t at random and rescale
  (mergekit keeps the L1 norm), then the mean / TIES' disjoint mean; p in 0.1 ... 0.9.
- ``ramplus_tl``: mergekit's built-in tensor-local RAM+ (alpha 0.2, its default); r grid.
- ``ram``: one setting (epsilon 1e-5). ``ram_plus``: r in R_GRID x rule in (clip, soft).
- ``ram_ties``: RAM with TIES on the shared region (trim each agent's shared updates to the
  top ``density`` per tensor, elect signs, disjoint mean), unique updates whole; r 0 (the
  authors' mode); density in RAM_TIES_DENSITIES.
- Analysis only (not competing for "best"): ``ram_plus`` with lambda pinned for every agent,
  and the paper's Figure 3, ``ram_unique``: one agent's unique updates at scale 1 or 1/N, the
  other agents at 0 (they count for the overlap but add nothing).

Every recipe computes and writes float32 (``dtype``, ``out_dtype``), so no method loses
small merged updates to bfloat16 rounding of its output.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional

import yaml

from benchmarks.agents.tasks import TASKS
from benchmarks.common import console_script, ratio_or_none, run_measured
from benchmarks.records import read_json
from mergekit_ram.stats.arithmetic import module_of

LOG = logging.getLogger(__name__)

SCALES = (0.1, 0.3, 0.5, 0.7, 0.9, 1.0)
TIES_DENSITIES = (0.1, 0.2, 0.3)
DROP_RATES = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
R_GRID = (0.0, 0.05, 0.1, 0.15, 0.2)
RULES = ("clip", "soft")
#: lambda pinned for every agent in ``ram_plus``: how much the unique updates matter.
PINNED_LAMBDAS = (0.0, 0.5, 1.5, 2.0, 3.0)
RAM_TIES_DENSITIES = (0.1, 0.2, 0.3, 0.5, 0.7, 1.0)
#: The scales of one agent's unique region in the paper's Figure 3: whole, and diluted to 1/N.
UNIQUE_SCALES = (1.0, 1 / 3)
FIGURE3 = "ram_unique (Figure 3)"
FAMILIES = ("task_arithmetic", "ties", "dare_linear", "dare_ties", "ramplus_tl", "ram", "ram_plus", "ram_ties")


@dataclass(frozen=True)
class Setting:
    """One merge: a mergekit method with its parameters.

    ``family`` groups the settings among which the best is selected; ``default`` marks the
    setting a user would take untuned; ``tuned`` settings compete for "best".
    ``model_parameters`` apply to every agent; a value given as ``{task: value}`` is per agent.
    """

    family: str
    method: str
    name: str
    label: str
    parameters: dict[str, Any] = field(default_factory=dict)
    model_parameters: dict[str, Any] = field(default_factory=dict)
    default: bool = False
    tuned: bool = True


def _num(value: float) -> str:
    return f"{value:g}"


# The names of the settings: the grid, the report and the plot look merges up by them.


def task_arithmetic_name(scale: float) -> str:
    return f"ta-l{_num(scale)}"


def ties_name(density: float, scale: float) -> str:
    return f"ties-d{_num(density)}-l{_num(scale)}"


def ram_plus_name(rule: str, r: float) -> str:
    return f"ramplus-{rule}-r{_num(r)}"


def ram_ties_name(density: float) -> str:
    return f"ramties-d{_num(density)}"


def unique_name(task: str, scale: float) -> str:
    return f"unique-{task}-s{scale:.3g}"


def merge_grid(pinned_lambdas: bool = True) -> list[Setting]:
    """Every setting of the experiment, in a fixed order (the order breaks ties)."""
    settings: list[Setting] = []
    for scale in SCALES:
        settings.append(
            Setting(
                "task_arithmetic",
                "task_arithmetic",
                task_arithmetic_name(scale),
                f"lambda={_num(scale)}",
                {"lambda": scale},
                {"weight": 1.0},
                default=scale == 0.3,
            )
        )
    for density in TIES_DENSITIES:
        for scale in SCALES:
            settings.append(
                Setting(
                    "ties",
                    "ties",
                    ties_name(density, scale),
                    f"density={_num(density)}, lambda={_num(scale)}",
                    {"lambda": scale, "normalize": True},
                    {"weight": 1.0, "density": density},
                    default=density == 0.2 and scale == 1.0,
                )
            )
    for method, short in (("dare_linear", "darel"), ("dare_ties", "daret")):
        for rate in DROP_RATES:
            settings.append(
                Setting(
                    method,
                    method,
                    f"{short}-p{_num(rate)}",
                    f"p={_num(rate)}",
                    {"normalize": True, "rescale": True},
                    {"weight": 1.0, "density": round(1.0 - rate, 2)},
                    default=rate == 0.5,
                )
            )
    for r in R_GRID:
        settings.append(
            Setting("ramplus_tl", "ramplus_tl", f"ramplustl-r{_num(r)}", f"r={_num(r)}", {"r": r}, default=r == 0.1)
        )
    settings.append(Setting("ram", "ram", "ram", "epsilon=1e-5", {"epsilon": 1e-5}, default=True))
    for rule in RULES:
        for r in R_GRID:
            settings.append(
                Setting(
                    "ram_plus",
                    "ram_plus",
                    ram_plus_name(rule, r),
                    f"r={_num(r)}, {rule}",
                    {"r": r, "alpha": 2.0, "rule": rule},
                    default=rule == "clip" and r == 0.1,
                )
            )
    for density in RAM_TIES_DENSITIES:
        settings.append(
            Setting(
                "ram_ties",
                "ram_ties",
                ram_ties_name(density),
                f"density={_num(density)}",
                {"density": density, "r": 0.0},
                default=density == 0.1,
            )
        )
    for task in TASKS:
        for scale in UNIQUE_SCALES:
            settings.append(
                Setting(
                    FIGURE3,
                    "ram_unique",
                    unique_name(task, scale),
                    f"{task} unique region, scale={scale:.3g}",
                    {},
                    {"scale": {other: scale if other == task else 0.0 for other in TASKS}},
                    tuned=False,
                )
            )
    if pinned_lambdas:
        for value in PINNED_LAMBDAS:
            settings.append(
                Setting(
                    "ram_plus lambda pinned",
                    "ram_plus",
                    f"ramplus-lambda{_num(value)}",
                    f"lambda={_num(value)} for every agent",
                    {"r": 0.1},
                    {"lambda": value},
                    tuned=False,
                )
            )
    return settings


def recipe(setting: Setting, base: str, agents: Mapping[str, str]) -> dict[str, Any]:
    """The mergekit YAML document for ``setting`` (absolute paths)."""
    models = []
    for task, path in agents.items():
        entry: dict[str, Any] = {"model": os.path.abspath(path)}
        if setting.model_parameters:
            entry["parameters"] = {
                name: value[task] if isinstance(value, dict) else value
                for name, value in setting.model_parameters.items()
            }
        models.append(entry)
    return {
        "merge_method": setting.method,
        "base_model": os.path.abspath(base),
        "models": models,
        "parameters": dict(setting.parameters),
        "dtype": "float32",
        "out_dtype": "float32",
    }


def run_mergekit(recipe_document: Mapping[str, Any], out_dir: str, seed: int) -> float:
    """Write ``recipe.yml`` and run ``mergekit-yaml`` on it, one CPU thread; returns its wall seconds.

    Its output goes to ``mergekit-yaml.log`` beside the recipe.
    """
    os.makedirs(out_dir, exist_ok=True)
    recipe_path = os.path.join(out_dir, "recipe.yml")
    with open(recipe_path, "w", encoding="utf-8") as handle:
        yaml.safe_dump(dict(recipe_document), handle, sort_keys=False)
    model_dir = os.path.join(out_dir, "model")
    shutil.rmtree(model_dir, ignore_errors=True)
    # Every pre-pass really runs (no cache of counts between the merges of a sweep).
    environment = dict(
        os.environ,
        HF_HUB_OFFLINE="1",
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
        MERGEKIT_RAM_CACHE="off",
    )
    command = [
        console_script("mergekit-yaml"),
        recipe_path,
        model_dir,
        "--copy-tokenizer",
        "--quiet",
        "--random-seed",
        str(seed),
    ]
    measurement = run_measured(command, env=environment, log_path=Path(out_dir) / "mergekit-yaml.log")
    if measurement["returncode"]:
        raise RuntimeError(f"mergekit-yaml failed on {recipe_path}:\n{measurement['log_tail']}")
    return measurement["wall_s"]


def ram_statistics(model_dir: str, names: Mapping[str, str]) -> Optional[dict[str, Any]]:
    """The ``ram_statistics.json`` mergekit-ram wrote into ``model_dir`` (None: not a RAM merge), by agent.

    ``names`` maps the model ids in the file (paths) to the agents' tasks. Per agent: its counts,
    overlap histogram, rho (None: infinite) and lambda, and in ``by_kind`` the per-tensor
    histograms summed into changed and unique counts per kind of weight.
    """
    path = os.path.join(model_dir, "ram_statistics.json")
    if not os.path.exists(path):
        return None
    data = read_json(path)

    def short(model: str) -> str:
        return names.get(model, names.get(os.path.abspath(model), model))

    kinds: dict[str, dict[str, dict[str, int]]] = {}
    for tensor in data["tensors"]:
        for model, histogram in zip(tensor["models"], tensor["histograms"]):
            counts = kinds.setdefault(short(model), {}).setdefault(
                module_of(tensor["name"]), {"parameters": 0, "changed": 0, "unique": 0}
            )
            counts["parameters"] += tensor["numel"]
            counts["changed"] += sum(histogram)
            counts["unique"] += histogram[0] if histogram else 0
    fields = ("parameters", "changed", "density", "unique", "shared", "overlap_histogram")
    models = {
        short(entry["model"]): {
            **{name: entry[name] for name in fields},
            "rho": ratio_or_none(entry["rho"]),
            "measured_rho": ratio_or_none(entry["measured_rho"]),
            "lambda": entry["lambda"],
        }
        for entry in data["models"]
    }
    return {"parameters": data["parameters"], "models": models, "by_kind": kinds}


def fingerprint(*parts: Any) -> str:
    """A short stable hash of JSON-able parts (cache keys)."""
    text = json.dumps(parts, sort_keys=True, default=_jsonable)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _jsonable(value: Any) -> Any:
    return asdict(value) if hasattr(value, "__dataclass_fields__") else str(value)


def file_digest(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()[:16]
