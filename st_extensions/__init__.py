"""sentence-transformers extensions of pyterrier-prob: modules, losses and models.

Usable on its own with sentence-transformers; knows nothing of PyTerrier.
"""

from st_extensions.distributions import BetaCosine, ExpCosine
from st_extensions.loading import load_model
from st_extensions.modules import MixtureOfLogits, QueryDistributionHead
from st_extensions.mol import build_mol_model, encode_components, find_mol
from st_extensions.pebr import build_pebr_model, default_model_path, encode_queries, query_distribution

__all__ = [
    "BetaCosine",
    "ExpCosine",
    "MixtureOfLogits",
    "QueryDistributionHead",
    "build_mol_model",
    "build_pebr_model",
    "default_model_path",
    "encode_components",
    "encode_queries",
    "find_mol",
    "load_model",
    "query_distribution",
]
