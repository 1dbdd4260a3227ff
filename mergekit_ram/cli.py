"""The ``mergekit-ram`` command: the demo, the probe, the check before sharing a merged folder, and
mergekit's scripts with the plugin registered. Imports stay inside the commands: ``--help`` is fast.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from typing import Any, Iterator

import click

#: What ``mergekit-ram demo`` leaves in a folder it made: a rerun may overwrite the files there.
DEMO_MARKER = ".mergekit-ram-demo"
MERGEKIT_SCRIPTS = {
    "yaml": ("mergekit.scripts.run_yaml", "mergekit-yaml"),
    "multi": ("mergekit.scripts.multimerge", "mergekit-multi"),
    "pytorch": ("mergekit.scripts.merge_raw_pytorch", "mergekit-pytorch"),
}


def _print_versions(context: click.Context, _: click.Parameter, value: bool) -> None:
    """``--version``: mergekit-ram, the mergekit it plugs into, and torch (with its build)."""
    if not value or context.resilient_parsing:
        return
    import torch

    from mergekit_ram.stats.arithmetic import package_versions

    build = "CPU build" if torch.version.cuda is None else f"CUDA {torch.version.cuda} build"
    for name, version in package_versions().items():
        click.echo(f"{name} {version}" + (f" ({build})" if name == "torch" else ""))
    context.exit()


@click.group()
@click.option(
    "--version",
    is_flag=True,
    expose_value=False,
    is_eager=True,
    callback=_print_versions,
    help="Show the versions of mergekit-ram, mergekit and torch, and exit.",
)
def main() -> None:
    """Reinforced Agent Merging (RAM, RAM+) for mergekit."""
    from mergekit_ram.interrupts import PlainWarnings

    PlainWarnings.install()


def _passthrough(kind: str) -> click.Command:
    script = MERGEKIT_SCRIPTS[kind][1]

    @click.command(
        kind,
        context_settings={"ignore_unknown_options": True, "allow_extra_args": True, "help_option_names": []},
        add_help_option=False,
        help=f"Run {script} with mergekit-ram registered explicitly (for environments where the "
        f"automatic registration is off or unavailable). Arguments are {script}'s.",
    )
    @click.pass_context
    def command(context: click.Context) -> None:
        mergekit_command(kind, f"mergekit-ram {kind}").main(args=list(context.args), prog_name=f"mergekit-ram {kind}")

    return command


for _kind in MERGEKIT_SCRIPTS:
    main.add_command(_passthrough(_kind))


def mergekit_command(kind: str, command: str) -> click.Command:
    """mergekit's console script ``kind`` (``MERGEKIT_SCRIPTS``) as its click command, the plugin registered."""
    import importlib

    from mergekit_ram.integration import register

    with needs_mergekit(command):
        register()
        return importlib.import_module(MERGEKIT_SCRIPTS[kind][0]).main


@contextlib.contextmanager
def needs_mergekit(command: str) -> Iterator[None]:
    """mergekit not installed: one line with the pip command, not an import traceback."""
    from mergekit_ram.errors import MissingExtraError

    try:
        yield
    except ModuleNotFoundError as error:
        if error.name is None or error.name.partition(".")[0] != "mergekit":
            raise
        from mergekit_ram.integration.internals import SUPPORTED_MERGEKIT

        raise MissingExtraError(
            f'{command} needs mergekit, which is not installed here: pip install "mergekit{SUPPORTED_MERGEKIT}"'
        ) from None


@main.command()
@click.argument("out_dir", type=click.Path(file_okay=False))
@click.option("--architecture", type=click.Choice(["qwen2", "llama"]), default="qwen2", show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
def demo(out_dir: str, architecture: str, seed: int) -> None:
    """Build a tiny base and three sparse RL-like agents locally, merge them with ram_plus.

    OUT_DIR must be new or empty, or a folder an earlier demo made (its .mergekit-ram-demo file):
    the demo overwrites its own files there and refuses a folder holding anything else.

    The agents' densities and overlaps follow the paper's Qwen2.5-7B agents (about 3%,
    46% and 54% of parameters changed). The merge runs through the real mergekit-yaml;
    the table is read from the ram_statistics.json it writes.
    """
    import yaml

    from mergekit_ram.stats.render import model_table
    from mergekit_ram.stats.schema import STATISTICS_FILE, statistics_from_dict
    from mergekit_ram.synthetic import PAPER_AGENTS, PAPER_OVERLAP, build_agents, tiny_config

    logging.basicConfig(level=logging.WARNING)
    started = time.perf_counter()
    out_dir = os.path.abspath(out_dir)
    claim_demo_folder(out_dir)
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
    arguments = [recipe_path, merged_path, "--quiet"]
    click.echo("Merging: mergekit-yaml " + " ".join(arguments))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the models are local: nothing to ask the Hub
    mergekit_yaml = mergekit_command("yaml", "mergekit-ram demo")  # mergekit-yaml's own command, run here
    mergekit_yaml.main(args=arguments, prog_name="mergekit-yaml", standalone_mode=False)

    with open(os.path.join(merged_path, STATISTICS_FILE), encoding="utf-8") as handle:
        statistics = statistics_from_dict(json.load(handle))
    click.echo(f"\n{model_table(statistics)}\n")
    click.echo(
        "Paper (Qwen2.5-7B agents): density 3.2% / 46.2% / 54.3%, rho ~14.9 / 1.45 / 1.11, lambda ~1.20 / 1.145 / 1.11"
    )
    click.echo(f"Merged model: {merged_path} ({time.perf_counter() - started:.1f} s)")


def claim_demo_folder(out_dir: str) -> None:
    """A new or empty ``out_dir`` (then marked), or one whose marker is a regular file: the demo overwrites it."""
    from mergekit_ram.files import UnreadableFile, open_regular

    os.makedirs(out_dir, exist_ok=True)
    entries = os.listdir(out_dir)
    marker = os.path.join(out_dir, DEMO_MARKER)
    if not entries:
        with open(marker, "x", encoding="utf-8") as handle:
            handle.write("made by mergekit-ram demo, which may overwrite every file here when run again\n")
        return
    if DEMO_MARKER not in entries:
        reason = f"holds files and no {DEMO_MARKER}"
    else:
        try:
            with open_regular(marker, follow_symlinks=False):
                return
        except (OSError, UnreadableFile) as error:
            reason = f"has a {DEMO_MARKER} the demo cannot trust ({error})"
    raise click.ClickException(
        f"mergekit-ram demo writes only into a new or empty folder, or one it made: {out_dir} {reason}; "
        f"choose a new or empty folder, or remove {out_dir}"
    )


@main.command()
@click.argument("recipe", type=click.Path(exists=True, dir_okay=False))
@click.option("--stage", "--name", "stage", default=None, help="Probe only this stage of a mergekit-multi file.")
@click.option(
    "-I",
    "--intermediate-dir",
    default="",
    help="Where mergekit-multi wrote the stages: lets a stage that merges an earlier one's output be probed.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the statistics as JSON on stdout.")
@click.option("--by-module", is_flag=True, help="Also split by embeddings, attention, MLP, norms, output head.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), help="Write the paper's Figure 2 as a PNG.")
@click.option("--refresh", is_flag=True, help="Recompute even if the pre-pass cache has these counts.")
@click.option("--cuda", is_flag=True, help="Count on the GPU.")
@click.option("--device", default=None, help="Count on this torch device (cpu, cuda, cuda:1, ...).")
@click.option("--lora-merge-cache", default=None, help="Where mergekit merges LoRA inputs (as mergekit-yaml).")
@click.option("--trust-remote-code", is_flag=True, help="As mergekit-yaml.")
@click.option("--allow-crimes", is_flag=True, help="As mergekit-yaml: let mergekit take models of other architectures.")
@click.option("-j", "--num-threads", type=int, default=None, help="Torch CPU threads.")
@click.option("-v", "--verbose", is_flag=True, help="Log the pre-pass; show the traceback of an error.")
def probe(
    recipe: str,
    stage: str | None,
    intermediate_dir: str,
    as_json: bool,
    by_module: bool,
    plot_path: str | None,
    refresh: bool,
    verbose: bool,
    **mergekit_options: Any,
) -> None:
    """Run only the pre-pass of a mergekit-ram RECIPE (ram, ram_plus, ram_ties, ram_unique) and report what RAM sees.

    Per model: parameters changed (count and density), shared and unique counts, the
    histogram by how many models changed each parameter, rho, and lambda under the
    recipe's r / alpha / rule. A mergekit-multi file: every mergekit-ram stage (or the
    one --stage names). Nothing is merged or written (but the cache and --plot).
    """
    from mergekit_ram.errors import reported
    from mergekit_ram.interrupts import Quiet
    from mergekit_ram.plot import check_plot_extra, plot_statistics
    from mergekit_ram.probe import probe_options, probe_report_json, probe_stages, select_stages, stage_plot_path
    from mergekit_ram.stats.render import histogram_table, model_table, module_table

    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING)
    with Quiet("Interrupted: the probe stopped; nothing was merged"):
        try:
            if plot_path is not None:
                check_plot_extra()  # before any work, and before the cache can answer
            with needs_mergekit("mergekit-ram probe"):
                options = probe_options(mergekit_options, quiet=as_json or not verbose)
                selection = select_stages(recipe, stage, intermediate_dir)
            for note in selection.not_probed:
                click.echo(f"note: {note}", err=True)
            reports = probe_stages(selection, options, refresh)
            if plot_path is not None:
                for chosen, statistics in reports:
                    plot_statistics(statistics, stage_plot_path(plot_path, chosen, selection))
        except Exception as error:
            found = reported(error, "probing")
            if found is None:
                raise
            if verbose:
                logging.getLogger(__name__).error("traceback of the error reported below", exc_info=error)
            if found is error:
                raise
            raise found from error
        if as_json:
            click.echo(json.dumps(probe_report_json(selection, reports, by_module), indent=2))
            return
        for index, (chosen, statistics) in enumerate(reports):
            if index:
                click.echo("")
            settings = ", ".join(f"{key} = {value}" for key, value in statistics.parameters.items())
            of = recipe if chosen.name is None else f"{recipe}, stage {chosen.name}"
            click.echo(f"{statistics.method} probe of {of} ({settings})\n")
            click.echo(model_table(statistics))
            click.echo("\nChanged parameters by how many models changed them (k):\n")
            click.echo(histogram_table(statistics))
            if by_module:
                click.echo("\nBy part of the network (rho local to that part; lambda uses the global rho):\n")
                click.echo(module_table(statistics))
            for warning in statistics.warnings:
                click.echo(f"\nwarning: {warning}", err=True)
            if plot_path is not None:
                click.echo(f"\nFigure written to {stage_plot_path(plot_path, chosen, selection)}")


def _license_id(context: click.Context, parameter: click.Parameter, value: str | None) -> str | None:
    """``--set-license``: an id as the Hub writes them."""
    from mergekit_ram.sharing import LICENSE_ID

    if value is not None and not LICENSE_ID.fullmatch(value):
        raise click.BadParameter(f"{value!r} is not a licence id of the Hub (lower case, such as apache-2.0 or mit)")
    return value


def _hub_ids(context: click.Context, parameter: click.Parameter, values: tuple[str, ...]) -> list[tuple[str, str]]:
    """``--hub-id LOCAL=ID``, each checked."""
    from mergekit_ram.hub_ids import parse_hub_id

    try:
        return [parse_hub_id(value) for value in values]
    except ValueError as error:
        raise click.BadParameter(str(error)) from None


def _hub_id_file(context: click.Context, parameter: click.Parameter, value: str | None) -> list[tuple[str, str]]:
    """``--hub-id-file FILE``: its mapping, each entry checked as ``--hub-id``."""
    from mergekit_ram.hub_ids import read_hub_id_file

    try:
        return read_hub_id_file(value) if value is not None else []
    except ValueError as error:
        raise click.BadParameter(str(error)) from None


@main.command()
@click.argument("out_dir", metavar="OUT", type=click.Path(exists=True, file_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON on stdout.")
@click.option("--accept-warnings", is_flag=True, help="Statistics warnings are notes, not problems (once read).")
@click.option(
    "--hub-id",
    "hub_ids",
    multiple=True,
    callback=_hub_ids,
    metavar="LOCAL=ID",
    help="First name the Hub id of a local model the merge read: its folder as you would type it, '=', the id "
    "(./models/coder=your-name/coder); repeat for each local model. README.md, mergekit_config.yml and "
    "ram_statistics.json are rewritten alike to name the ids.",
)
@click.option(
    "--hub-id-file",
    "hub_id_file",
    type=click.Path(exists=True, dir_okay=False),
    callback=_hub_id_file,
    metavar="FILE",
    help="As --hub-id, from a YAML or JSON mapping of local folders to Hub ids ({./models/coder: your-name/coder}); "
    "relative folders are from the current folder, as in mergekit's recipes.",
)
@click.option(
    "--set-license",
    "license_id",
    default=None,
    callback=_license_id,
    metavar="ID",
    help="First write `license: ID` into the card's front matter (an id the input models' licences allow).",
)
def check(
    out_dir: str,
    as_json: bool,
    accept_warnings: bool,
    hub_ids: list[tuple[str, str]],
    hub_id_file: list[tuple[str, str]],
    license_id: str | None,
) -> None:
    """What stops sharing the merged model folder OUT on the Hub: every problem, one line each with its fix.

    Checks: the merge finished; the weights load with safetensors and hold no NaN or Inf (every
    tensor is read); config.json and a tokenizer are there; the card has a licence, base_model,
    base_model_relation: merge and the merge tag; the card, mergekit_config.yml and
    ram_statistics.json name no local folder; no statistics warnings; and a note for what
    `hf upload` would upload that is not part of the model. Exit status: 0 ready, 1 problems,
    2 usage.

    With --hub-id (or --hub-id-file) and --set-license, OUT is made ready first, in one step:
    the merge's local models named by their Hub ids in all three files (the recipe rewritten
    without its comments, the card written again by mergekit's card writer), base_model and
    base_model_relation: merge in the card, the licence; the three files replaced at once under
    the merge's own lock, and only once nothing is missing (each local model needs its id; a
    card edited since the merge is refused). Running it again changes nothing.
    """
    from mergekit_ram.errors import MergeInterrupted
    from mergekit_ram.hub_ids import prepare_for_hub
    from mergekit_ram.integration.card import mergekit_card
    from mergekit_ram.interrupts import Quiet
    from mergekit_ram.sharing import check_folder

    pairs = [*hub_ids, *hub_id_file]
    try:
        changed = prepare_for_hub(out_dir, pairs, license_id, mergekit_card) if pairs or license_id is not None else []
    except KeyboardInterrupt:
        raise MergeInterrupted(
            f"Interrupted: {out_dir} holds its card, recipe and statistics as they were or all three rewritten, "
            "never a mix; run the step again to finish it"
        ) from None
    state = f"{out_dir} holds the rewritten {', '.join(changed)}" if changed else f"{out_dir} was not changed"
    with Quiet(f"Interrupted: the check stopped; {state}"):  # it only reads from here on
        report = check_folder(out_dir, accept_warnings, changed)
        if changed:
            click.echo(f"rewrote {', '.join(changed)}", err=True)
        if as_json:
            click.echo(json.dumps(report.to_json(), indent=2))
        else:
            click.echo("\n".join(report.lines()))
    click.get_current_context().exit(0 if report.ready else 1)
