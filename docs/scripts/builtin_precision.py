"""How far mergekit 0.1.5's built-in ``ram`` and ``ramplus_tl`` are from the exact result on bfloat16 checkpoints.

    python docs/scripts/builtin_precision.py [--hidden 128 --layers 4 --vocab 1024]

Backs the arithmetic rows of docs/method.md. Builds a bfloat16 base and three sparse
agents locally with the paper's densities and overlaps (``mergekit_ram.synthetic``, as
``mergekit-ram demo``), then runs the real ``mergekit-yaml`` four times:

- ``ram`` with ``MERGEKIT_RAM_AUTOLOAD=0``: mergekit's built-in RAM;
- ``ramplus_tl`` (always mergekit's), with its defaults and with ``alpha: 2.0``;
- ``ram_plus`` (this plugin), for comparison.

The exact result comes from ``tests/reference.py`` (float32, whole tensors, one step per
equation), with the lambdas each method's rule gives: 1 for RAM, the tensor-local rho and
the recipe's alpha for ``ramplus_tl``, the global rho for ``ram_plus``. A merged element is
counted as wrong when it differs from the exact float32 result rounded to bfloat16 (the
checkpoint dtype). ``ramplus_tl`` writes float32; its output is also compared with the exact
float32 result as it is.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from typing import Any, Callable

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, os.pardir))

from mergekit_ram.stats.render import markdown_table  # noqa: E402
from mergekit_ram.synthetic import PAPER_AGENTS, PAPER_OVERLAP, build_agents, tiny_config  # noqa: E402
from tests import reference  # noqa: E402
from tests.conftest import load_weights, run_script, write_recipe  # noqa: E402

EPSILON = 1e-5


def merge(recipe: dict[str, Any], directory: str, name: str, env: dict[str, str]) -> dict[str, torch.Tensor]:
    """The weights ``mergekit-yaml`` writes for ``recipe`` (every pre-pass runs: no cache)."""
    path = write_recipe(os.path.join(directory, f"{name}.yml"), recipe)
    out = os.path.join(directory, name)
    run_script("mergekit-yaml", path, out, "--quiet", env={"MERGEKIT_RAM_CACHE": "off", **env})
    return load_weights(out)


def exact(
    base: dict[str, torch.Tensor],
    finetunes: list[dict[str, torch.Tensor]],
    lambdas_of: Callable[[str], list[float]],
) -> dict[str, torch.Tensor]:
    return {
        name: reference.merge(tensor, [ft[name] for ft in finetunes], EPSILON, lambdas_of(name))
        for name, tensor in base.items()
    }


def wrong_share(
    merged: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], dtype: torch.dtype, overlap: dict[str, Any]
) -> tuple[float, float, float]:
    """Shares of the elements that differ: of all, of those one model changed, of those 2+ changed."""
    wrong = [0, 0, 0]
    total = [0, 0, 0]
    for name, tensor in expected.items():
        differs = merged[name].to(dtype) != tensor.to(dtype)
        for index, where in enumerate((torch.ones_like(differs), overlap[name] == 1, overlap[name] >= 2)):
            wrong[index] += int((differs & where).sum())
            total[index] += int(where.sum())
    return wrong[0] / total[0], wrong[1] / total[1], wrong[2] / total[2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    arguments = parser.parse_args()

    with tempfile.TemporaryDirectory() as directory:
        config = tiny_config(
            "llama",
            hidden_size=arguments.hidden,
            intermediate_size=2 * arguments.hidden,
            num_layers=arguments.layers,
            vocab_size=arguments.vocab,
        )
        base_path, agent_paths, _ = build_agents(
            os.path.join(directory, "models"), config, PAPER_OVERLAP, PAPER_AGENTS, seed=arguments.seed
        )
        base = load_weights(base_path)
        finetunes = [load_weights(path) for path in agent_paths]
        recipe = {"base_model": base_path, "models": [{"model": path} for path in agent_paths]}
        counts = {name: reference.counts(t, [ft[name] for ft in finetunes], EPSILON) for name, t in base.items()}
        overlap = {  # per element: how many agents changed it
            name: torch.stack(reference.masks(t, [ft[name] for ft in finetunes], EPSILON)).to(torch.int64).sum(0)
            for name, t in base.items()
        }
        numel = sum(t.numel() for t in base.values())
        shared = [sum(counts[name].shared[i] for name in base) for i in range(len(finetunes))]
        unique = [sum(counts[name].unique[i] for name in base) for i in range(len(finetunes))]
        global_lambdas = [reference.lambda_clip(reference.rho(s, u), 0.1, 2.0) for s, u in zip(shared, unique)]

        def tensor_local(alpha: float) -> Callable[[str], list[float]]:
            return lambda name: [
                reference.lambda_clip(reference.rho(s, u), 0.1, alpha)
                for s, u in zip(counts[name].shared, counts[name].unique)
            ]

        builtin = {"MERGEKIT_RAM_AUTOLOAD": "0"}
        in_float32 = {"dtype": "float32", "out_dtype": "bfloat16"}
        runs: list[tuple[str, dict[str, Any], dict[str, str], Callable[[str], list[float]]]] = [
            # label, recipe keys, environment, exact lambdas per tensor
            ("mergekit ram (built-in)", {"merge_method": "ram"}, builtin, lambda name: [1.0] * 3),
            (
                "mergekit ram (built-in), `dtype: float32`, `out_dtype: bfloat16`",
                {"merge_method": "ram", **in_float32},
                builtin,
                lambda name: [1.0] * 3,
            ),
            ("mergekit ramplus_tl, defaults (r 0.1, alpha 0.2)", {"merge_method": "ramplus_tl"}, {}, tensor_local(0.2)),
            (
                "mergekit ramplus_tl, alpha 2.0",
                {"merge_method": "ramplus_tl", "parameters": {"alpha": 2.0}},
                {},
                tensor_local(2.0),
            ),
            (
                "mergekit ramplus_tl, alpha 2.0, `dtype: float32`, `out_dtype: bfloat16`",
                {"merge_method": "ramplus_tl", "parameters": {"alpha": 2.0}, **in_float32},
                {},
                tensor_local(2.0),
            ),
            ("mergekit-ram ram_plus", {"merge_method": "ram_plus"}, {}, lambda name: global_lambdas),
        ]
        print(
            f"{len(base)} tensors, {numel:,} parameters, bfloat16; 3 agents, densities "
            + " / ".join(f"{100 * (s + u) / numel:.1f}%" for s, u in zip(shared, unique))
            + f"; elements changed by one agent {sum(int((c == 1).sum()) for c in overlap.values()) / numel:.1%}, "
            + f"by 2+ agents {sum(int((c >= 2).sum()) for c in overlap.values()) / numel:.1%}\n"
        )
        header = ["wrong: of all elements", "of those 1 agent changed", "of those 2+ agents changed"]
        rows = [["method", "output dtype", *header]]
        float32_rows = [["method", *header]]
        for index, (label, keys, env, lambdas_of) in enumerate(runs):
            merged = merge({**keys, **recipe}, directory, f"run{index}", env)
            expected = exact(base, finetunes, lambdas_of)
            dtypes = {str(t.dtype).removeprefix("torch.") for t in merged.values()}
            shares = wrong_share(merged, expected, torch.bfloat16, overlap)
            rows.append([label, ", ".join(sorted(dtypes)), *[f"{s:.3%}" for s in shares]])
            if dtypes == {"float32"}:
                shares = wrong_share(merged, expected, torch.float32, overlap)
                float32_rows.append([label, *[f"{s:.3%}" for s in shares]])
        print(markdown_table(rows, "llr"))
        if len(float32_rows) > 1:
            print("\nfloat32 outputs compared with the exact float32 result, not rounded:\n")
            print(markdown_table(float32_rows))


if __name__ == "__main__":
    main()
