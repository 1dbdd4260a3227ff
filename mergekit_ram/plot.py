"""The paper's Figure 2 for a probe (needs matplotlib, the extra ``mergekit-ram[plot]``)."""

from __future__ import annotations

from mergekit_ram.stats.data import RamStatistics
from mergekit_ram.stats.render import display_names


def check_plot_extra() -> None:
    """matplotlib is importable: checked before the probe does any work."""
    from mergekit_ram.errors import MissingExtraError

    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise MissingExtraError(
            "--plot needs matplotlib, which is not installed here: pip install matplotlib "
            "(what the extra 'mergekit-ram[plot]' installs)"
        ) from None


def plot_statistics(statistics: RamStatistics, path: str) -> None:
    """Left: share of parameters each model changed. Right: how many models changed them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = display_names(statistics)
    labels = [names[stats.model] for stats in statistics.models]
    width = max((len(stats.histogram) for stats in statistics.models), default=1)
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 0.6 * len(labels) + 2.6), constrained_layout=True)

    densities = [100 * stats.density for stats in statistics.models]
    bars = left.barh(labels, densities, color="#4c72b0")
    left.bar_label(bars, labels=[f"{d:.1f}%" for d in densities], padding=3)
    left.set_xlabel("parameters changed (% of all)")
    left.set_xlim(0, max(densities + [1.0]) * 1.2)
    left.invert_yaxis()
    left.set_title("Density of each task vector")

    colors = plt.get_cmap("viridis")([k / max(width - 1, 1) for k in range(width)])
    offsets = [0.0] * len(labels)
    for k in range(width):
        shares = [
            100 * stats.histogram[k] / stats.active if stats.active and k < len(stats.histogram) else 0.0
            for stats in statistics.models
        ]
        label = "unique (k = 1)" if k == 0 else f"shared, k = {k + 1}"
        bars = right.barh(labels, shares, left=offsets, color=colors[k], label=label)
        if k == 0:
            right.bar_label(
                bars,
                labels=[f"{share:.1f}%" if share >= 10 else "" for share in shares],
                label_type="center",
                color="white",
            )
        offsets = [offset + share for offset, share in zip(offsets, shares)]
    right.set_xlabel("share of the model's changed parameters (%)")
    right.set_xlim(0, 100)
    right.invert_yaxis()
    right.set_yticklabels([])
    right.set_title("Changed by how many models (k)")
    handles, names_k = right.get_legend_handles_labels()
    figure.legend(handles, names_k, loc="outside lower right", ncol=min(width, 4))

    epsilon = statistics.parameters.get("epsilon")
    figure.suptitle(f"{statistics.method} probe: {len(labels)} models, epsilon = {epsilon}")
    figure.savefig(path, dpi=120)
    plt.close(figure)
