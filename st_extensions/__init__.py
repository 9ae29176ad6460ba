"""sentence-transformers extensions of pyterrier-prob: modules, losses and models.

Usable on its own with sentence-transformers; knows nothing of PyTerrier.
"""

from st_extensions.cross_encoder import VarCrossEncoder, build_var_cross_encoder
from st_extensions.defaults import default_model_path
from st_extensions.distributions import BetaCosine, ExpCosine
from st_extensions.loading import load_model
from st_extensions.modules import MixtureOfLogits, MultiBranchQueryEncoder, QueryDistributionHead
from st_extensions.mol import build_mol_model, encode_components, find_mol
from st_extensions.partial import LayerStateCache, PartialTransformer, partial_model
from st_extensions.pebr import build_pebr_model, encode_queries, query_distribution
from st_extensions.unierf import (
    branch_text,
    build_unierf_dataset,
    build_unierf_model,
    encode_branches,
    find_branches,
    unierf_columns,
)

__all__ = [
    "BetaCosine",
    "ExpCosine",
    "LayerStateCache",
    "MixtureOfLogits",
    "MultiBranchQueryEncoder",
    "PartialTransformer",
    "QueryDistributionHead",
    "VarCrossEncoder",
    "branch_text",
    "build_mol_model",
    "build_pebr_model",
    "build_unierf_dataset",
    "build_unierf_model",
    "build_var_cross_encoder",
    "default_model_path",
    "encode_components",
    "encode_branches",
    "encode_queries",
    "find_branches",
    "find_mol",
    "load_model",
    "partial_model",
    "query_distribution",
    "unierf_columns",
]
