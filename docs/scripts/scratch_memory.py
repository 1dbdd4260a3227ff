"""Scratch memory of one tensor group: mergekit 0.1.5's built-in ``ram`` / ``ramplus_tl`` against this plugin.

    python docs/scripts/scratch_memory.py

Backs the memory row of docs/method.md. Same measurement as
``tests/test_kernel.py::test_scratch_memory_is_bounded_by_the_chunk``
(``benchmarks.memory.peak_allocated_bytes``): the torch profiler records every CPU
allocation and free while one group is merged; the peak of the
running sum, minus the bytes of the returned tensor, is the scratch. Inputs are allocated
before profiling, so they are not counted.

The built-in kernels are called as mergekit calls them for one group (``merge_group`` on a
``TensorGroup``), whatever is registered under their names; ours is
``mergekit_ram.kernel.merge_tensors`` as the merge runs it (merge only, no counting; with
counting, as in ``ram`` merges, its buffers grow by 8 bytes per chunk element and model).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from mergekit.merge_methods.base import TensorGroup
from mergekit.merge_methods.ram import ram_merge as builtin_ram
from mergekit.merge_methods.ram import ramplus_tl_merge as builtin_ramplus_tl

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, os.pardir))

from benchmarks.memory import peak_allocated_bytes  # noqa: E402
from mergekit_ram.kernel import CHUNK_ELEMENTS, merge_tensors  # noqa: E402

EPSILON = 1e-5


def inputs(numel: int, n: int, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A base and n fine-tunes, each changing a random half of the elements by about 1e-2."""
    generator = torch.Generator().manual_seed(seed)
    base = torch.randn(numel, generator=generator) * 0.02
    finetunes = []
    for _ in range(n):
        changed = torch.rand(numel, generator=generator) < 0.5
        delta = torch.randn(numel, generator=generator) * 0.01
        finetunes.append((base + changed * delta).to(dtype))
    return base.to(dtype), finetunes


def measure(numel: int, n: int, dtype: torch.dtype) -> dict[str, tuple[int, torch.dtype]]:
    """Scratch bytes (peak minus the output) and output dtype, per implementation."""
    base, finetunes = inputs(numel, n, dtype)
    group = TensorGroup.from_tensors([base, *finetunes], base_index=0, name="w")
    lambdas = [1.0 + 0.05 * (index + 1) for index in range(n)]
    runs = {
        "mergekit ram (built-in)": lambda: builtin_ram.merge_group(group, epsilon=EPSILON),
        "mergekit ramplus_tl": lambda: builtin_ramplus_tl.merge_group(group, r=0.1, alpha=0.2, epsilon=EPSILON),
        "mergekit-ram ram_plus": lambda: merge_tensors(base, finetunes, EPSILON, lambdas).merged,
    }
    results = {}
    for name, run in runs.items():
        peak, output = peak_allocated_bytes(run, threads=1)
        results[name] = (peak - output.numel() * output.element_size(), output.dtype)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=1 << 20)
    parser.add_argument("--models", type=int, nargs="+", default=[3])
    arguments = parser.parse_args()
    print(f"one tensor of {arguments.numel:,} elements; chunk of the plugin's kernel: {CHUNK_ELEMENTS:,} elements\n")
    print("| implementation | input dtype | N | output dtype | scratch (MiB) | scratch bytes per element |")
    print("|---|---|---:|---|---:|---:|")
    for dtype in (torch.float32, torch.bfloat16):
        for n in arguments.models:
            for name, (scratch, out_dtype) in measure(arguments.numel, n, dtype).items():
                print(
                    f"| {name} | {str(dtype).removeprefix('torch.')} | {n} | {str(out_dtype).removeprefix('torch.')} "
                    f"| {scratch / 2**20:.1f} | {scratch / arguments.numel:.1f} |"
                )


if __name__ == "__main__":
    main()
