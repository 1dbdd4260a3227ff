"""RAM statistics: per-tensor counts summed per model, rho and lambda, and their renderings.

Three layers, each importing only the ones before it:

- :mod:`.data`: the frozen values (``TensorCounts``, ``ModelStatistics``, ``ModuleStatistics``,
  ``RamStatistics``);
- :mod:`.arithmetic`: counts summed per model and per part of the network, rho, lambda
  (``model_lambda``), the warnings (``build_statistics``, ``by_module``);
- :mod:`.schema` (``ram_statistics.json``, versioned) and :mod:`.render` (tables, model
  card, log).
"""

from mergekit_ram.stats.arithmetic import (
    DENSE,
    MODULES,
    build_statistics,
    by_merged_module,
    by_module,
    model_lambda,
    module_of,
    package_versions,
    sum_counts,
)
from mergekit_ram.stats.data import (
    ModelStatistics,
    ModuleStatistics,
    OverlapCounts,
    Pin,
    RamStatistics,
    Source,
    TensorCounts,
)
from mergekit_ram.stats.render import (
    PROJECT_URL,
    card_markdown,
    compact_table,
    display_names,
    format_rho,
    format_table,
    histogram_table,
    log_statistics,
    markdown_table,
    model_table,
    module_table,
)
from mergekit_ram.stats.schema import (
    INFINITY,
    READABLE_SCHEMAS,
    SCHEMA_VERSION,
    STATISTICS_FILE,
    counts_from_dict,
    counts_to_dict,
    read_ratio,
    statistics_from_dict,
    statistics_to_dict,
    statistics_to_json,
    write_ratio,
)

__all__ = [
    "DENSE",
    "INFINITY",
    "MODULES",
    "PROJECT_URL",
    "READABLE_SCHEMAS",
    "SCHEMA_VERSION",
    "STATISTICS_FILE",
    "ModelStatistics",
    "ModuleStatistics",
    "OverlapCounts",
    "Pin",
    "RamStatistics",
    "Source",
    "TensorCounts",
    "build_statistics",
    "by_merged_module",
    "by_module",
    "card_markdown",
    "compact_table",
    "counts_from_dict",
    "counts_to_dict",
    "display_names",
    "format_rho",
    "format_table",
    "histogram_table",
    "log_statistics",
    "markdown_table",
    "model_lambda",
    "module_of",
    "module_table",
    "package_versions",
    "read_ratio",
    "statistics_from_dict",
    "statistics_to_dict",
    "statistics_to_json",
    "sum_counts",
    "model_table",
    "write_ratio",
]
