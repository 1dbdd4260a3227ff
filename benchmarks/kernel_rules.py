"""The kernel's merge rules side by side, and against an older kernel, in one run.

For N fine-tunes of one bfloat16 tensor (the agents of ``benchmarks.kernel``), each call of
``mergekit_ram.kernel`` as the merge methods make it, on torch's thread count: ``ram`` (merge
only, and merge + count as a ``ram`` merge runs it), ``ram_plus`` (lambdas != 1), the
pre-pass (``count_overlaps``), ``ram_ties`` (density 0.1 and 1.0) and ``ram_unique``. With
``--before REV``, every call also runs on the ``kernel.py`` of that git revision, loaded as a
module of its own (it imports torch only; one that takes ``workers`` gets torch's thread
count, as the merge methods called it). Every round runs each call once, in turns, so that
all see the same load on a shared machine.

With ``--candidates``, the ways of threading the chunk loop beside the one the kernel takes
(one intra-op thread): the same kernel on torch's intra-op threads, the same with 2^22-element
chunks (larger operations, 16x the scratch), and a pool of two workers of one thread each
taking half the tensor (the pre-pass and ``ram``'s merge). With ``--load N``, every round
runs again with N busy background processes (``benchmarks.common.background_load``).

Time per element: the fastest round and the median (after one warm-up call each). Scratch:
the peak of torch's allocations during one call on one thread, the output excluded, per
element of a chunk (``benchmarks.memory``).

    python -m benchmarks.kernel_rules --numel 16M --n 3 --repeats 7 --before HEAD~3
    python -m benchmarks.kernel_rules --numel 16M --n 3 --before 8842a28 --candidates --load 4
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import inspect
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Optional, Sequence
from unittest import mock

import torch

from benchmarks.common import background_load, fmt_count, median, parse_size
from benchmarks.kernel import EPSILON, LAMBDAS, kernel_inputs, measure
from benchmarks.memory import peak_allocated_bytes
from mergekit_ram import kernel
from mergekit_ram.stats.render import markdown_table

#: The denominators of the ratio column: the same call on the older kernel, or ram's merge.
RAM = "ram, merge only"
COUNTING_RAM = "ram, merge + count"


def kernel_at(revision: str) -> ModuleType:
    """``mergekit_ram/kernel.py`` as it was at ``revision``, imported as the module ``kernel_<revision>``."""
    source = subprocess.run(
        ["git", "show", f"{revision}:mergekit_ram/kernel.py"], capture_output=True, text=True, check=True
    ).stdout
    path = Path(tempfile.mkdtemp()) / "kernel_before.py"
    path.write_text(source, encoding="utf-8")
    name = f"kernel_{revision}".replace("~", "_").replace("^", "_")
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def calls(module: ModuleType, base: torch.Tensor, finetunes: list[torch.Tensor]) -> dict[str, Callable[[], Any]]:
    """Every call measured on ``module``, by label."""
    lambdas = list(LAMBDAS[: len(finetunes)])
    takes_workers = "workers" in inspect.signature(module.merge_tensors).parameters

    def threads() -> dict[str, int]:
        """An older kernel's worker threads: torch's count when called (1 under the scratch measurement)."""
        return {"workers": torch.get_num_threads()} if takes_workers else {}

    def merge(*args: Any, **options: Any) -> Callable[[], Any]:
        return lambda: module.merge_tensors(base, finetunes, EPSILON, *args, **threads(), **options)

    return {
        RAM: merge(),
        COUNTING_RAM: merge(count=True),
        "ram_plus, merge (lambdas)": merge(lambdas),
        "pre-pass, count only": lambda: module.count_overlaps(base, finetunes, EPSILON, **threads()),
        "ram_ties, density 0.1": merge(shared="ties", density=0.1),
        "ram_ties, density 1.0": merge(shared="ties", density=1.0),
        "ram_unique": merge(shared="base"),
    }


def on_torch_threads(function: Callable[[], Any]) -> Callable[[], Any]:
    """``function`` with the kernel's chunk loop left on torch's intra-op threads."""

    def call() -> Any:
        with mock.patch.object(kernel, "_one_thread", lambda device: contextlib.nullcontext()):
            return function()

    return call


def pooled(
    call: Callable[[torch.Tensor, list[torch.Tensor]], Any], base: torch.Tensor, finetunes: list[torch.Tensor]
) -> Callable[[], Any]:
    """``call`` on each half of the group (split at a chunk boundary), in two threads of one intra-op thread each."""
    half = -(-base.numel() // 2 // kernel.CHUNK_ELEMENTS) * kernel.CHUNK_ELEMENTS
    parts = [
        (base.view(-1)[part], [f.view(-1)[part] for f in finetunes]) for part in (slice(0, half), slice(half, None))
    ]
    pool = ThreadPoolExecutor(2)
    return lambda: list(pool.map(lambda part: call(*part), parts))


def candidates(base: torch.Tensor, finetunes: list[torch.Tensor]) -> dict[str, Callable[[], Any]]:
    """The other ways of threading the chunk loop, by the label of the call they compare with."""
    large = 1 << 22
    return {
        f"{name} (torch threads)": on_torch_threads(function)
        for name, function in calls(kernel, base, finetunes).items()
    } | {
        "pre-pass, count only (2^22 chunks, torch threads)": on_torch_threads(
            lambda: kernel.count_overlaps(base, finetunes, EPSILON, chunk_elements=large)
        ),
        f"{RAM} (2^22 chunks, torch threads)": on_torch_threads(
            lambda: kernel.merge_tensors(base, finetunes, EPSILON, chunk_elements=large)
        ),
        "pre-pass, count only (pool of 2)": pooled(lambda b, f: kernel.count_overlaps(b, f, EPSILON), base, finetunes),
        f"{RAM} (pool of 2)": pooled(lambda b, f: kernel.merge_tensors(b, f, EPSILON), base, finetunes),
    }


def scratch_per_chunk_element(function: Callable[[], Any], chunk: int) -> float:
    """Peak torch allocations of one call on one thread, minus its output, per chunk element."""
    peak, result = peak_allocated_bytes(function, threads=1)
    output = result.merged if hasattr(result, "merged") else torch.empty(0)
    return (peak - output.numel() * output.element_size()) / chunk


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--numel", default="16M", help="elements per tensor (default 16M)")
    parser.add_argument("--n", type=int, default=3, help="fine-tuned models (default 3)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--before", help="git revision whose kernel.py runs beside this one")
    parser.add_argument("--candidates", action="store_true", help="other ways of threading the chunk loop too")
    parser.add_argument("--load", type=int, default=0, help="then again with this many busy background processes")
    parser.add_argument("--no-scratch", action="store_true", help="skip the scratch column")
    parser.add_argument("--only", help="'|'-separated beginnings of the calls to run (default all)")
    args = parser.parse_args(argv)
    numel = parse_size(args.numel)
    base, finetunes = kernel_inputs(numel, args.n)
    ours = calls(kernel, base, finetunes)
    # label: (call, the label of the call its time is compared with)
    measured = {f"{name} (new)": (function, f"{RAM} (new)") for name, function in ours.items()}
    if args.before:
        before = calls(kernel_at(args.before), base, finetunes)
        measured |= {f"{name} (before)": (function, f"{name} (new)") for name, function in before.items()}
        measured |= {f"{name} (new)": (ours[name], f"{name} (before)") for name in before}
    if args.candidates:
        against = {label: label.rsplit(" (", 1)[0] + " (new)" for label in candidates(base, finetunes)}
        measured |= {label: (function, against[label]) for label, function in candidates(base, finetunes).items()}
    if args.only:
        kept = tuple(prefix.strip() for prefix in args.only.split("|"))
        measured = {label: call for label, call in measured.items() if label.startswith(kept)}
    for load in sorted({0, args.load}):
        with background_load(load):
            start_load = os.getloadavg()[0]
            times = measure({label: function for label, (function, _) in measured.items()}, args.repeats)
            end_load = os.getloadavg()[0]
        rows = [
            [
                label,
                f"{min(times[label]) / numel * 1e9:.2f}",
                f"{median(times[label]) / numel * 1e9:.2f}",
                f"{median(times[label]) / median(times[against]):.2f}x {against}",
                "" if args.no_scratch else f"{scratch_per_chunk_element(function, kernel.CHUNK_ELEMENTS):.1f}",
            ]
            for label, (function, against) in measured.items()
        ]
        print(
            f"kernel alone, {fmt_count(numel)} bfloat16 elements, N = {args.n}, torch threads "
            f"{torch.get_num_threads()}, {load} busy background processes, load average {start_load:.2f} -> "
            f"{end_load:.2f}"
        )
        headers = ["call", "ns / element (min)", "ns / element (median)", "median ratio", "scratch B / chunk element"]
        print(markdown_table([headers, *rows], "l"), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
