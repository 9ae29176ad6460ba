"""pyterrier-prob: probabilistic and learned-similarity retrieval for PyTerrier.

PyTerrier transformers, indexes, evaluation and the ``pyterrier-prob`` command; the models, modules and
losses they use live in :mod:`st_extensions`.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

#: Public names, imported on first use (``import pyterrier_prob`` stays cheap for the command line).
_EXPORTS: dict[str, str] = {
    "ProbBiEncoder": "pyterrier_prob.encoders",
    "DenseIndex": "pyterrier_prob.index",
    "CDFCutoffRetriever": "pyterrier_prob.cutoff",
    "ScoreCutoffRetriever": "pyterrier_prob.cutoff",
    "TopKRetriever": "pyterrier_prob.cutoff",
    "threshold_search": "pyterrier_prob.cutoff",
    "count_above": "pyterrier_prob.cutoff",
    "MoLIndex": "pyterrier_prob.mol_index",
    "MoLEncoder": "pyterrier_prob.mol",
    "MoLRetriever": "pyterrier_prob.mol",
    "MoLReranker": "pyterrier_prob.mol",
    "VarCrossEncoderReranker": "pyterrier_prob.rerank",
    "QueryNoise": "pyterrier_prob.noise",
    "NOISE_TYPES": "pyterrier_prob.noise",
    "all_noise": "pyterrier_prob.noise",
    "percent_no": "pyterrier_prob.hard_queries",
    "no_relevant_in_top": "pyterrier_prob.hard_queries",
    "hard_queries": "pyterrier_prob.hard_queries",
    "hard_query_table": "pyterrier_prob.hard_queries",
    "MultiBranchRetriever": "pyterrier_prob.branches",
    "UniERFEncoder": "pyterrier_prob.branches",
    "TriggerText": "pyterrier_prob.branches",
    "branch_quotas": "pyterrier_prob.branches",
    "merge_branch_lists": "pyterrier_prob.branches",
    "unierf_training_data": "pyterrier_prob.branches",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'pyterrier_prob' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
