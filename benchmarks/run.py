"""The benchmark in one command: every part, then ``docs/performance.md``.

Each part runs as its own ``python -m benchmarks.PART`` child under the same environment
(offline, the chosen checkout's ``mergekit_ram`` first on PYTHONPATH, pre-pass cache off),
prints its tables and writes its JSON under ``benchmarks/results/``; the page is then
regenerated from all results there.

    python -m benchmarks.run --size 120m --repeats 3
    python -m benchmarks.run --size 120m --repeats 3 --load 4   # the methods again beside 4 busy processes
    python -m benchmarks.run --size 120m --size 500m --parts methods,kernel,inmemory --inmemory-size 120m
    python -m benchmarks.run --parts outofcore --scale-size scale        # needs ~30 GB of disk, a quiet machine
"""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
from typing import Optional, Sequence

from benchmarks.common import REPO_ROOT, child_env, plugin_checkout, setup_logging
from benchmarks.models import SIZES
from benchmarks.report import write_doc

LOG = logging.getLogger(__name__)

PARTS = ("methods", "kernel", "inmemory", "outofcore")
DEFAULT_PARTS = ("methods", "kernel", "inmemory")


def part_commands(args: argparse.Namespace) -> list[list[str]]:
    """The child command lines for the chosen parts, in order."""
    python = [sys.executable, "-m"]
    plugin = ["--plugin", str(args.plugin)] if args.plugin else []
    commands = []
    parts = [part.strip() for part in args.parts.split(",") if part.strip()]
    unknown = set(parts) - set(PARTS)
    if unknown:
        raise SystemExit(f"unknown parts {sorted(unknown)}; choose from {', '.join(PARTS)}")
    sizes = args.size or ["120m"]
    if "methods" in parts:
        for size in sizes:
            command = [*python, "benchmarks.methods", "--size", size, "--repeats", str(args.repeats)]
            command += ["--out-shard-size", args.out_shard_size, *plugin]
            if args.mergekit_args:
                command += ["--mergekit-args", args.mergekit_args]
            commands.append(command)
            if args.load:
                commands.append([*command, "--load", str(args.load)])
    if "kernel" in parts:
        commands.append([*python, "benchmarks.kernel", "--numel", args.numel, *plugin])
    if "inmemory" in parts:
        size = args.inmemory_size or sizes[0]
        commands.append([*python, "benchmarks.scale", "inmemory", "--size", size, *plugin])
        if args.cap_gib:
            commands[-1] += ["--cap-gib", str(args.cap_gib)]
    if "outofcore" in parts:
        command = [*python, "benchmarks.scale", "outofcore", "--size", args.scale_size, *plugin]
        commands.append(command + ["--out-shard-size", args.out_shard_size])
    return commands


def warn_about_load() -> None:
    """A "quiet" run on a loaded machine measures the load too: say so before minutes of noisy runs."""
    load, cpus = os.getloadavg()[0], os.cpu_count() or 1
    if load > 0.5 * cpus:
        LOG.warning("load average %.1f on %d CPUs before the quiet runs: the ratios include that load", load, cpus)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", action="append", choices=sorted(SIZES), help="methods sizes (repeatable)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--parts", default=",".join(DEFAULT_PARTS), help=f"comma-separated of {', '.join(PARTS)}")
    parser.add_argument("--out-shard-size", default="1B")
    parser.add_argument("--mergekit-args", default="", help="extra mergekit-yaml arguments for the methods runs")
    parser.add_argument("--load", type=int, default=0, help="the methods again beside this many busy processes")
    parser.add_argument("--numel", default="16M", help="kernel tensor size")
    parser.add_argument("--inmemory-size", choices=sorted(SIZES), help="default: the first --size")
    parser.add_argument("--cap-gib", type=float, help="RLIMIT_DATA for the in-memory comparison")
    parser.add_argument("--scale-size", default="scale", choices=sorted(SIZES))
    parser.add_argument(
        "--plugin", type=plugin_checkout, help="checkout whose mergekit_ram is measured (default: this one)"
    )
    parser.add_argument("--no-docs", action="store_true", help="do not rewrite docs/performance.md")
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args(argv)
    setup_logging(args.verbose)
    env = child_env(args.plugin)
    warn_about_load()
    for command in part_commands(args):
        LOG.info("running %s", " ".join(command[2:]))
        subprocess.run(command, env=env, cwd=REPO_ROOT, check=True)
        print()
    if not args.no_docs:
        print(f"wrote {write_doc()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
