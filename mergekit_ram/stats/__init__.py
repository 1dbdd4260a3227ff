"""RAM statistics: per-tensor counts summed per model, rho and lambda, and their renderings.

Three layers, each importing only the ones before it: :mod:`.data` (the frozen values),
:mod:`.arithmetic` (counts summed per model and per part of the network, rho, lambda, the
warnings), then :mod:`.schema` (``ram_statistics.json``) and :mod:`.render` (tables, card, log).
Import from those modules; the package itself names only what reading a statistics file needs.
"""

from mergekit_ram.stats.data import RamStatistics
from mergekit_ram.stats.render import model_table
from mergekit_ram.stats.schema import statistics_from_dict

__all__ = ["RamStatistics", "model_table", "statistics_from_dict"]
