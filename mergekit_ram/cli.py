"""The ``mergekit-ram`` command: the demo, and fallbacks that register before mergekit runs.

Imports stay inside the commands, so ``mergekit-ram --help`` does not pay for mergekit.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import time

import click

MERGEKIT_SCRIPTS = {
    "yaml": ("mergekit.scripts.run_yaml", "mergekit-yaml"),
    "multi": ("mergekit.scripts.multimerge", "mergekit-multi"),
    "pytorch": ("mergekit.scripts.merge_raw_pytorch", "mergekit-pytorch"),
}


@click.group()
@click.version_option(package_name="mergekit-ram")
def main() -> None:
    """Reinforced Agent Merging (RAM, RAM+) for mergekit."""


def _passthrough(kind: str) -> click.Command:
    module_name, script = MERGEKIT_SCRIPTS[kind]

    @click.command(
        kind,
        context_settings={"ignore_unknown_options": True, "allow_extra_args": True, "help_option_names": []},
        add_help_option=False,
        help=f"Run {script} with mergekit-ram registered explicitly (for environments where the "
        f"automatic registration is off or unavailable). Arguments are {script}'s.",
    )
    @click.pass_context
    def command(context: click.Context) -> None:
        import importlib

        from mergekit_ram import register

        register()
        script_main = importlib.import_module(module_name).main
        script_main.main(args=list(context.args), prog_name=f"mergekit-ram {kind}")

    return command


for _kind in MERGEKIT_SCRIPTS:
    main.add_command(_passthrough(_kind))


def console_script(name: str) -> str:
    """The path of an installed console script, next to this interpreter first."""
    candidate = os.path.join(os.path.dirname(sys.executable), name)
    if os.path.exists(candidate):
        return candidate
    found = shutil.which(name)
    if found is None:
        raise click.ClickException(f"{name} is not installed; install mergekit (pip install mergekit-ram pulls it in)")
    return found


@main.command()
@click.argument("out_dir", type=click.Path(file_okay=False))
@click.option("--architecture", type=click.Choice(["qwen2", "llama"]), default="qwen2", show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
def demo(out_dir: str, architecture: str, seed: int) -> None:
    """Build a tiny base and three sparse RL-like agents locally, merge them with ram_plus.

    The agents' densities and overlaps follow the paper's Qwen2.5-7B agents (about 3%,
    46% and 54% of parameters changed). The merge runs through the real mergekit-yaml;
    the table is read from the ram_statistics.json it writes.
    """
    import yaml

    from mergekit_ram.stats import STATISTICS_FILE, RamStatistics
    from mergekit_ram.synthetic import PAPER_AGENTS, PAPER_OVERLAP, build_agents, tiny_config

    logging.basicConfig(level=logging.WARNING)
    started = time.perf_counter()
    out_dir = os.path.abspath(out_dir)
    models_dir = os.path.join(out_dir, "models")
    click.echo(f"Building a tiny {architecture} base and three agents in {models_dir} ...")
    config = tiny_config(architecture, hidden_size=128, intermediate_size=256, num_layers=4, vocab_size=1024)
    base_path, agent_paths, _ = build_agents(models_dir, config, PAPER_OVERLAP, PAPER_AGENTS, seed=seed)

    recipe = {
        "merge_method": "ram_plus",
        "base_model": base_path,
        "models": [{"model": path} for path in agent_paths],
        "parameters": {"r": 0.1, "alpha": 2.0, "epsilon": 1.0e-5},
        "dtype": "bfloat16",
    }
    recipe_path = os.path.join(out_dir, "recipe.yml")
    with open(recipe_path, "w", encoding="utf-8") as handle:
        yaml.safe_dump(recipe, handle, sort_keys=False)
    merged_path = os.path.join(out_dir, "merged")
    command = [console_script("mergekit-yaml"), recipe_path, merged_path, "--quiet"]
    click.echo("Merging: " + " ".join(command))
    environment = {**os.environ, "HF_HUB_OFFLINE": "1"}
    completed = subprocess.run(command, env=environment, capture_output=True, text=True)
    if completed.returncode != 0:
        raise click.ClickException(f"mergekit-yaml failed:\n{completed.stderr[-4000:]}")

    with open(os.path.join(merged_path, STATISTICS_FILE), encoding="utf-8") as handle:
        statistics = RamStatistics.from_dict(json.load(handle))
    click.echo("")
    click.echo(statistics.table())
    click.echo("")
    click.echo(
        "Paper (Qwen2.5-7B agents): density 3.2% / 46.2% / 54.3%, rho ~14.9 / 1.45 / 1.11, lambda ~1.20 / 1.145 / 1.11"
    )
    click.echo(f"Merged model: {merged_path} ({time.perf_counter() - started:.1f} s)")
