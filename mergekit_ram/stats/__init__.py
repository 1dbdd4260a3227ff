"""RAM statistics in layers, each importing only those before it: :mod:`.data` (frozen values),
:mod:`.arithmetic` (sums, rho, lambda, warnings), :mod:`.schema` (the JSON) and :mod:`.render` (text)."""

from mergekit_ram.stats.data import RamStatistics
from mergekit_ram.stats.render import model_table
from mergekit_ram.stats.schema import statistics_from_dict

__all__ = ["RamStatistics", "model_table", "statistics_from_dict"]
