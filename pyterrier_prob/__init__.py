"""pyterrier-prob: probabilistic and learned-similarity retrieval for PyTerrier.

Each paper's PyTerrier side is one subpackage (:mod:`pyterrier_prob.pebr`, :mod:`~pyterrier_prob.mol`,
:mod:`~pyterrier_prob.varce`, :mod:`~pyterrier_prob.unierf`) on shared pieces (:mod:`~pyterrier_prob.index`,
:mod:`~pyterrier_prob.collections`, :mod:`~pyterrier_prob.training`, :mod:`~pyterrier_prob.evaluation`,
:mod:`~pyterrier_prob.fusion`, :mod:`~pyterrier_prob.atomic`); :mod:`pyterrier_prob.experiments` holds what
``pyterrier-prob <paper>`` runs. The models, modules and losses they use live in :mod:`st_extensions`.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

#: Public names, imported on first use (``import pyterrier_prob`` stays cheap for the command line).
_EXPORTS: dict[str, str] = {
    "ProbBiEncoder": "pyterrier_prob.pebr",
    "DenseIndex": "pyterrier_prob.index",
    "CDFCutoffRetriever": "pyterrier_prob.pebr",
    "RecallTargetCutoff": "pyterrier_prob.pebr",
    "CalibratedLaw": "pyterrier_prob.pebr.calibration",
    "ScoreCutoffRetriever": "pyterrier_prob.pebr",
    "TopKRetriever": "pyterrier_prob.pebr",
    "threshold_search": "pyterrier_prob.index",
    "count_above": "pyterrier_prob.index",
    "make_searcher": "pyterrier_prob.index",
    "merge_runs": "pyterrier_prob.index",
    "ShardedSearcher": "pyterrier_prob.index",
    "MoLIndex": "pyterrier_prob.mol",
    "MoLEncoder": "pyterrier_prob.mol",
    "MoLRetriever": "pyterrier_prob.mol",
    "MoLReranker": "pyterrier_prob.mol",
    "VarCrossEncoderReranker": "pyterrier_prob.varce",
    "ScoreInterpolation": "pyterrier_prob.fusion",
    "QueryNoise": "pyterrier_prob.varce",
    "NOISE_TYPES": "pyterrier_prob.varce",
    "all_noise": "pyterrier_prob.varce",
    "percent_no": "pyterrier_prob.varce",
    "no_relevant_in_top": "pyterrier_prob.varce",
    "hard_queries": "pyterrier_prob.varce",
    "hard_query_table": "pyterrier_prob.varce",
    "MultiBranchRetriever": "pyterrier_prob.unierf",
    "UniERFEncoder": "pyterrier_prob.unierf",
    "TriggerText": "pyterrier_prob.unierf",
    "branch_quotas": "pyterrier_prob.unierf",
    "merge_branch_lists": "pyterrier_prob.unierf",
    "unierf_training_data": "pyterrier_prob.unierf",
    "load_collection": "pyterrier_prob.collections",
    "fine_tune": "pyterrier_prob.training",
    "Recipe": "pyterrier_prob.training",
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
