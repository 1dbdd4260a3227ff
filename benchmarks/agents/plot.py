"""The figure of ``docs/quality.md``: merge accuracy, sensitivity to scale, agent statistics."""

from __future__ import annotations

import os

from benchmarks.agents.evaluate import standard_error
from benchmarks.agents.merges import FAMILIES, SCALES
from benchmarks.agents.report import Results, agent_statistics, best_and_default
from benchmarks.agents.tasks import TASKS


def plot_results(results: Results, path: str) -> None:
    """Four panels, all test accuracy: methods (best / default), per task, scale sweeps, statistics."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    main = results.main_variant
    sizes = results.test_size()
    figure, axes = plt.subplots(2, 2, figsize=(13, 9.5))

    # (a) average test accuracy, best and default of each method
    axis = axes[0, 0]
    for offset, kind, style in ((-0.2, 0, {"color": "tab:blue"}), (0.2, 1, {"color": "tab:orange"})):
        heights, errors = [], []
        for family in FAMILIES:
            record = best_and_default(results.merges_of(main, family))[kind]
            scores = record["scores"]["test"] if record else {t: 0.0 for t in (*TASKS, "avg")}
            heights.append(100 * scores["avg"])
            errors.append(100 * standard_error({t: scores[t] for t in TASKS}, sizes))
        axis.bar(
            [i + offset for i in range(len(FAMILIES))],
            heights,
            0.4,
            yerr=errors,
            capsize=3,
            label=("best (chosen on validation)", "default")[kind],
            **style,
        )
    base = results.checkpoint_scores["base"]["test"]["avg"]
    specialists = sum(results.checkpoint_scores[f"{main}/{t}"]["test"][t] for t in TASKS) / len(TASKS)
    axis.axhline(100 * base, color="grey", linestyle=":", label="base")
    axis.axhline(100 * specialists, color="black", linestyle="--", label="each agent on its own task")
    axis.set_xticks(range(len(FAMILIES)), FAMILIES, rotation=25, ha="right")
    axis.set_ylabel("test accuracy, mean of 3 tasks (%)")
    axis.set_title("(a) merged models")
    axis.legend(fontsize=8, loc="lower right")

    # (b) per-task accuracy of base, agents and the best merge of each method
    axis = axes[0, 1]
    rows = [("base", results.checkpoint_scores["base"]["test"])]
    rows += [(f"{t} agent", results.checkpoint_scores[f"{main}/{t}"]["test"]) for t in TASKS]
    for family in FAMILIES:
        best = best_and_default(results.merges_of(main, family))[0]
        if best:
            rows.append((f"{family} (best)", best["scores"]["test"]))
    width = 0.8 / len(TASKS)
    for index, task in enumerate(TASKS):
        axis.barh(
            [i + (index - 1) * width for i in range(len(rows))], [100 * s[task] for _, s in rows], width, label=task
        )
    axis.set_yticks(range(len(rows)), [name for name, _ in rows])
    axis.invert_yaxis()
    axis.set_xlabel("test accuracy (%)")
    axis.set_title("(b) per task")
    axis.legend(fontsize=8)

    # (c) sensitivity: scale of all task vectors (TA, TIES) or of the unique updates (RAM lambda)
    axis = axes[1, 0]
    for family, prefix in (("task_arithmetic", "ta-l"), ("ties", "ties-d0.2-l")):
        points = [(s, results.merge(main, f"{prefix}{s:g}")) for s in SCALES]
        points = [(s, m["scores"]["test"]["avg"]) for s, m in points if m]
        if points:
            axis.plot([s for s, _ in points], [100 * a for _, a in points], marker="o", label=f"{family}: lambda")
    pinned = sorted(
        results.merges_of(main, "ram_plus lambda pinned") + results.merges_of(main, "ram"),
        key=lambda m: m["setting"]["model_parameters"].get("lambda", 1.0),
    )
    if pinned:
        axis.plot(
            [m["setting"]["model_parameters"].get("lambda", 1.0) for m in pinned],
            [100 * m["scores"]["test"]["avg"] for m in pinned],
            marker="s",
            label="RAM: lambda on unique updates",
        )
    axis.axhline(100 * base, color="grey", linestyle=":")
    axis.set_xlabel("scale (lambda)")
    axis.set_ylabel("test accuracy, mean of 3 tasks (%)")
    axis.set_title("(c) sensitivity to scaling")
    axis.legend(fontsize=8)

    # (d) agent statistics per snapshot: density and composition by overlap
    axis = axes[1, 1]
    labels, bottoms = [], []
    colors = ("tab:green", "tab:olive", "tab:red")
    position = 0
    for variant in results.variants:
        statistics = agent_statistics(results, variant)
        if statistics is None:
            continue
        for task in TASKS:
            model = statistics["models"][task]
            histogram = model["overlap_histogram"]
            bottom = 0.0
            for k in range(1, len(TASKS) + 1):
                share = 100 * histogram.get(str(k), 0) / max(model["parameters"], 1)
                axis.bar(
                    position,
                    share,
                    0.7,
                    bottom=bottom,
                    color=colors[k - 1],
                    label=f"changed by {k} agent{'s' if k > 1 else ''}" if position == 0 else None,
                )
                bottom += share
            labels.append(f"{task}\n{variant.removeprefix('step')} st.")
            bottoms.append(bottom)
            position += 1
        position += 0.5
    ticks = [i + (i // len(TASKS)) * 0.5 for i in range(len(labels))]
    axis.set_xticks(ticks, labels, fontsize=8)
    axis.set_ylabel("share of all parameters (%)")
    axis.set_title("(d) agents' task vectors: density by overlap (Figure 2)")
    axis.legend(fontsize=8)

    figure.suptitle(f"RL agents merged with mergekit ({results.parameters / 1e6:.1f}M-parameter Llama, test split)")
    figure.tight_layout()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
