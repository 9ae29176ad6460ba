"""sentence-transformers Modules that are saved inside our models."""

from st_extensions.modules.adapter import LinearAdapter
from st_extensions.modules.branches import MultiBranchQueryEncoder
from st_extensions.modules.mol import MixtureOfLogits
from st_extensions.modules.query_distribution import QueryDistributionHead

__all__ = ["LinearAdapter", "MixtureOfLogits", "MultiBranchQueryEncoder", "QueryDistributionHead"]
