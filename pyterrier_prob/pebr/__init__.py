"""pEBR's PyTerrier side (``shared/papers/pebr.md``): the CDF / score cutoff retrievers (:mod:`.cutoff`), calibrated
per-query laws (:mod:`.calibration`) and ranked-list truncation with a conformal recall target (:mod:`.rlt`). The
encoder and the top-K retriever are plain dense retrieval (:mod:`pyterrier_prob.dense`), re-exported here. The
experiment is :mod:`pyterrier_prob.experiments.pebr`."""

from pyterrier_prob.dense import PARAM_COLUMNS, ProbBiEncoder, ProbDocEncoder, ProbQueryEncoder, TopKRetriever
from pyterrier_prob.index.exact import CutoffHits, count_above, threshold_search
from pyterrier_prob.pebr.cutoff import CDFCutoffRetriever, ScoreCutoffRetriever
from pyterrier_prob.pebr.rlt import RecallTargetCutoff

__all__ = [
    "CDFCutoffRetriever",
    "CutoffHits",
    "PARAM_COLUMNS",
    "ProbBiEncoder",
    "ProbDocEncoder",
    "ProbQueryEncoder",
    "RecallTargetCutoff",
    "ScoreCutoffRetriever",
    "TopKRetriever",
    "count_above",
    "threshold_search",
]
