"""The figure of ``docs/quality.md``: merge accuracy, sensitivity to scale, agent statistics."""

from __future__ import annotations

import os
from typing import Any

from benchmarks.agents.evaluate import standard_error
from benchmarks.agents.merges import FAMILIES, SCALES, task_arithmetic_name, ties_name
from benchmarks.agents.records import Results, agent_statistics, best_and_default, variant_steps
from benchmarks.agents.tasks import TASKS

COLORS = {"add": "tab:blue", "rev": "tab:orange", "tool": "tab:green"}


def _methods_panel(axis: Any, results: Results, variant: str, letter: str) -> None:
    """Test average of the best (validation) and default setting of every method."""
    sizes = results.test_size()
    for offset, kind, color in ((-0.2, 0, "tab:blue"), (0.2, 1, "tab:orange")):
        heights, errors = [], []
        for family in FAMILIES:
            record = best_and_default(results.merges_of(variant, family))[kind]
            scores = record.scores["test"] if record else {t: 0.0 for t in (*TASKS, "avg")}
            heights.append(100 * scores["avg"])
            errors.append(100 * standard_error({t: scores[t] for t in TASKS}, sizes))
        label = ("best (chosen on validation)", "default")[kind]
        axis.bar(
            [i + offset for i in range(len(FAMILIES))], heights, 0.4, yerr=errors, capsize=3, color=color, label=label
        )
    base = results.base_scores()["avg"]
    specialists = results.specialists_average(variant)
    axis.axhline(100 * base, color="grey", linestyle=":", label="base")
    axis.axhline(100 * specialists, color="black", linestyle="--", label="each agent on its own task")
    axis.set_ylim(100 * base - 10, 100 * specialists + 8)
    axis.set_xticks(range(len(FAMILIES)), FAMILIES, rotation=25, ha="right")
    axis.set_ylabel("test accuracy, mean of 3 tasks (%)")
    axis.set_title(f"({letter}) merges of the agents after {variant_steps(variant)} RL steps")
    axis.legend(fontsize=7, loc="upper left", ncol=2)


def plot_results(results: Results, path: str) -> None:
    """Six panels; every accuracy is on the test split."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    main = results.main_variant
    early = [v for v in results.variants if v != main]
    figure, axes = plt.subplots(2, 3, figsize=(19, 10.5))

    _methods_panel(axes[0, 0], results, main, "a")
    if early:
        _methods_panel(axes[0, 1], results, early[0], "b")
    else:
        axes[0, 1].axis("off")

    # (c) per-task accuracy of base, agents and the best merge of each method
    axis = axes[0, 2]
    rows = [("base", results.base_scores())]
    rows += [(f"{t} agent", results.agent_scores(main, t)) for t in TASKS]
    for family in FAMILIES:
        best = best_and_default(results.merges_of(main, family))[0]
        if best:
            rows.append((f"{family} (best)", best.scores["test"]))
    width = 0.8 / len(TASKS)
    for index, task in enumerate(TASKS):
        positions = [i + (index - 1) * width for i in range(len(rows))]
        axis.barh(positions, [100 * s[task] for _, s in rows], width, label=task, color=COLORS[task])
    axis.set_yticks(range(len(rows)), [name for name, _ in rows])
    axis.invert_yaxis()
    axis.set_xlabel("test accuracy (%)")
    axis.set_title(f"(c) per task, agents after {variant_steps(main)} RL steps")
    axis.legend(fontsize=8, loc="lower right")

    # (d) scaling every task vector (TA, TIES) or only the unique updates (RAM with pinned lambda)
    axis = axes[1, 0]
    for variant, style in ((main, "-"), *((v, "--") for v in early)):
        for family, name, color in (
            ("task_arithmetic", task_arithmetic_name, "tab:blue"),
            ("ties", lambda scale: ties_name(0.2, scale), "tab:orange"),
        ):
            merges = [(s, results.merge(variant, name(s))) for s in SCALES]
            points = [(s, m.scores["test"]["avg"]) for s, m in merges if m]
            if points:
                axis.plot(
                    [s for s, _ in points],
                    [100 * a for _, a in points],
                    style,
                    marker="o",
                    color=color,
                    label=f"{family} (density 0.2), {variant_steps(variant)} steps"
                    if family == "ties"
                    else f"{family}, {variant_steps(variant)} steps",
                )
    pinned = sorted(
        results.merges_of(main, "ram_plus lambda pinned") + results.merges_of(main, "ram"),
        key=lambda m: m.setting.model_parameters.get("lambda", 1.0),
    )
    if pinned:
        axis.plot(
            [m.setting.model_parameters.get("lambda", 1.0) for m in pinned],
            [100 * m.scores["test"]["avg"] for m in pinned],
            marker="s",
            color="tab:green",
            label=f"RAM, lambda on unique updates only, {variant_steps(main)} steps",
        )
    axis.axhline(100 * results.base_scores()["avg"], color="grey", linestyle=":", label="base")
    axis.set_xlabel("lambda")
    axis.set_ylabel("test accuracy, mean of 3 tasks (%)")
    axis.set_title("(d) scaling the merged update")
    axis.legend(fontsize=7)

    # (e) the paper's Figure 2: density and composition by overlap, with independence marks
    axis = axes[1, 1]
    labels: list[str] = []
    colors = ("tab:green", "tab:olive", "tab:red")
    position = 0.0
    ticks = []
    for variant in results.variants:
        statistics = agent_statistics(results, variant)
        analysis = results.analysis.get(variant)
        updates = analysis.updates.agents if analysis else {}
        if statistics is None:
            continue
        for task in TASKS:
            model = statistics.counts.models[task]
            bottom = 0.0
            for k in range(1, len(TASKS) + 1):
                share = 100 * model.changed_by(k) / max(model.parameters, 1)
                label = f"changed by {k} agent{'s' if k > 1 else ''}" if not labels else None
                axis.bar(position, share, 0.7, bottom=bottom, color=colors[k - 1], label=label)
                bottom += share
            if task in updates:
                independent = 100 * model.density * updates[task].unique_share_if_independent
                axis.plot(
                    [position - 0.35, position + 0.35],
                    [independent] * 2,
                    color="black",
                    label="changed by 1 if independent" if not labels else None,
                )
            labels.append(f"{task}\n{variant_steps(variant)} steps")
            ticks.append(position)
            position += 1
        position += 0.5
    axis.set_xticks(ticks, labels, fontsize=8)
    axis.set_ylabel("share of all parameters (%)")
    axis.set_title("(e) the agents' task vectors (the paper's Figure 2)")
    axis.legend(fontsize=7)

    # (f) dose-response: share of each agent's own-task gain reached by base + lambda * tau
    axis = axes[1, 2]
    for variant, style in ((main, "-"), *((v, "--") for v in early)):
        analysis = results.analysis.get(variant)
        if not analysis:
            continue
        response = analysis.dose_response
        for task in TASKS:
            base = results.base_scores()[task]
            doses = [float(d) for d in response[task]]
            full = response[task][max(response[task], key=float)]
            gain = max(full - base, 1e-9)
            axis.plot(
                [0.0, *doses],
                [0.0, *[100 * (a - base) / gain for a in response[task].values()]],
                style,
                marker="o",
                color=COLORS[task],
                label=f"{task} agent, {variant_steps(variant)} steps",
            )
    axis.axvline(1 / 3, color="grey", linestyle=":", label="1/3: what averaging 3 agents applies")
    axis.set_xlabel("lambda (one agent alone: base + lambda * tau)")
    axis.set_ylabel("share of the agent's own-task gain (%)")
    axis.set_title("(f) how much of each update is needed")
    axis.legend(fontsize=7)

    figure.suptitle(
        f"RL agents of a {results.parameters / 1e6:.1f}M-parameter Llama merged with mergekit-yaml "
        "(test split; error bars: one standard error)"
    )
    figure.tight_layout()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    figure.savefig(path, dpi=100)
    plt.close(figure)
