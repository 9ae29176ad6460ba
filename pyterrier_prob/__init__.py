"""pyterrier-prob: probabilistic and learned-similarity retrieval for PyTerrier.

Each paper's PyTerrier side is one subpackage (:mod:`pyterrier_prob.pebr`, :mod:`~pyterrier_prob.mol`,
:mod:`~pyterrier_prob.varce`, :mod:`~pyterrier_prob.unierf`) on shared pieces (:mod:`~pyterrier_prob.index`,
:mod:`~pyterrier_prob.collections`, :mod:`~pyterrier_prob.training`, :mod:`~pyterrier_prob.evaluation`,
:mod:`~pyterrier_prob.fusion`, :mod:`~pyterrier_prob.atomic`); :mod:`pyterrier_prob.experiments` holds what
``pyterrier-prob <paper>`` runs. The models, modules and losses they use live in :mod:`st_extensions`.
"""

from st_extensions.lazy import lazy_exports

__version__ = "0.1.0"

_PUBLIC: dict[str, str] = {  # module -> the names it gives to ``pyterrier_prob``
    "pyterrier_prob.pebr": "ProbBiEncoder CDFCutoffRetriever RecallTargetCutoff ScoreCutoffRetriever TopKRetriever",
    "pyterrier_prob.pebr.calibration": "CalibratedLaw",
    "pyterrier_prob.index": "DenseIndex threshold_search count_above make_searcher merge_runs ShardedSearcher",
    "pyterrier_prob.mol": "MoLIndex MoLEncoder MoLRetriever MoLReranker",
    "pyterrier_prob.varce": "VarCrossEncoderReranker QueryNoise NOISE_TYPES all_noise percent_no no_relevant_in_top "
    "hard_queries hard_query_table",
    "pyterrier_prob.fusion": "ScoreInterpolation",
    "pyterrier_prob.unierf": "MultiBranchRetriever UniERFEncoder TriggerText branch_quotas merge_branch_lists "
    "unierf_training_data UniERFDataConfig",
    "pyterrier_prob.collections": "load_collection",
    "pyterrier_prob.training": "fine_tune Recipe",
}
#: Public names, imported on first use (``import pyterrier_prob`` stays cheap for the command line).
__all__, __getattr__, __dir__ = lazy_exports(__name__, _PUBLIC)
__all__ = ["__version__", *__all__]
