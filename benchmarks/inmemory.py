"""The whole-model-in-memory float32 approach, as a baseline for memory and time.

What the authors' release does, written here from the paper's definitions (none of their
code is used): every model is loaded whole as float32, every task vector is materialised,
the masks and overlap counts are kept for the whole model, the global rho and lambda are
computed from them, then the model is merged. About 32 bytes per parameter for three
fine-tunes (base 4, fine-tunes 3 x 4, task vectors 3 x 4, masks 3 x 1, counts 1).

Two choices differ from the authors' script, so the outputs can be compared bit for bit
with ``ram_plus``: lambda follows the paper (``1 + r * clip(rho, 0, alpha)``, not their
``1 + (R - 1) * min(1, rho)``) and the output is saved in the checkpoint dtype (bfloat16),
not float32. Neither changes the memory or time of the approach much.

    python -m benchmarks.inmemory BASE AGENT [AGENT ...] --out DIR
"""

from __future__ import annotations

import argparse
import logging
import shutil
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from benchmarks.common import setup_logging
from benchmarks.records import read_json, write_json

LOG = logging.getLogger(__name__)

State = dict[str, torch.Tensor]
#: The baseline's report of its own merge (rho, lambda, merge_s, total_s), beside the output.
BASELINE_FIGURES_FILE = "inmemory_statistics.json"


def shard_files(directory: Path) -> list[Path]:
    """The safetensors files of a checkpoint, from its index when it has one (mergekit names its shards freely)."""
    index = directory / "model.safetensors.index.json"
    if index.exists():
        return [directory / name for name in dict.fromkeys(read_json(index)["weight_map"].values())]
    return sorted(directory.glob("*.safetensors"))


def load_float32(directory: Path) -> State:
    """A whole checkpoint as float32 tensors (each tensor converted as it is read)."""
    state: State = {}
    for path in shard_files(directory):
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():
                state[name] = handle.get_tensor(name).float()
    return state


def stored_dtype(directory: Path) -> torch.dtype:
    with safe_open(str(shard_files(directory)[0]), framework="pt") as handle:
        return handle.get_tensor(next(iter(handle.keys()))).dtype


def merge_in_memory(
    base_dir: Path, agent_dirs: Sequence[Path], *, epsilon: float = 1e-5, r: float = 0.1, alpha: float = 2.0
) -> tuple[State, list[float], list[float]]:
    """RAM+ with everything resident; returns the merged float32 state, rho and lambda per agent."""
    base = load_float32(base_dir)
    models = [load_float32(directory) for directory in agent_dirs]
    task_vectors = [{name: model[name] - base[name] for name in base} for model in models]
    masks = [{name: tau.abs() > epsilon for name, tau in vectors.items()} for vectors in task_vectors]
    counts: State = {}
    for name in base:
        counts[name] = torch.zeros(base[name].shape, dtype=torch.uint8)
        for mask in masks:
            counts[name] += mask[name]

    rhos, lambdas = [], []
    for mask in masks:
        shared = sum(int((mask[name] & (counts[name] >= 2)).sum()) for name in base)
        unique = sum(int((mask[name] & (counts[name] == 1)).sum()) for name in base)
        rho = shared / unique if unique else (0.0 if shared == 0 else float("inf"))
        rhos.append(rho)
        lambdas.append(1.0 + r * min(max(rho, 0.0), alpha))
    LOG.info("rho %s, lambda %s", [round(x, 4) for x in rhos], [round(x, 4) for x in lambdas])

    merged: State = {}
    for name in base:
        total = torch.zeros_like(base[name])
        for vectors, mask in zip(task_vectors, masks):
            total += vectors[name] * mask[name]
        mean = total / counts[name].clamp(min=1)
        unique_part = torch.zeros_like(total)
        for vectors, mask, lam in zip(task_vectors, masks, lambdas):
            unique_part += torch.where(mask[name] & (counts[name] == 1), vectors[name] * lam, 0.0)
        merged[name] = torch.where(counts[name] == 1, unique_part, mean) + base[name]
    return merged, rhos, lambdas


def save_sharded(state: State, out: Path, dtype: torch.dtype, config_source: Path, shard_bytes: int = 10**9) -> None:
    """Write ``state`` in ``dtype`` as HF-style shards with an index, and copy the config."""
    out.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in state.items():
        converted = tensor.to(dtype).contiguous()
        if shards[-1] and size + converted.nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = converted
        size += converted.nbytes
    weight_map = {}
    for index, shard in enumerate(shards):
        filename = f"model-{index + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / filename), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, filename))
    total = sum(tensor.nbytes for shard in shards for tensor in shard.values())
    write_json(
        out / "model.safetensors.index.json", {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=None
    )
    shutil.copy(config_source / "config.json", out / "config.json")


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("base", type=Path)
    parser.add_argument("agents", type=Path, nargs="+")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--epsilon", type=float, default=1e-5)
    parser.add_argument("--r", type=float, default=0.1)
    parser.add_argument("--alpha", type=float, default=2.0)
    args = parser.parse_args(argv)
    setup_logging(False)
    started = time.perf_counter()
    merged, rhos, lambdas = merge_in_memory(args.base, args.agents, epsilon=args.epsilon, r=args.r, alpha=args.alpha)
    merged_s = time.perf_counter() - started
    save_sharded(merged, args.out, stored_dtype(args.base), args.base)
    figures = {"rho": rhos, "lambda": lambdas, "merge_s": merged_s, "total_s": time.perf_counter() - started}
    write_json(args.out / BASELINE_FIGURES_FILE, figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
