"""pEBR's PyTerrier side (``shared/papers/pebr.md``): encoders that add ``query_vec`` and the per-query law's
parameters, and the CDF / score / top-k cutoff retrievers; calibrated per-query laws (:mod:`.calibration`) and
ranked-list truncation with a conformal recall target (:mod:`.rlt`). The experiment is
:mod:`pyterrier_prob.experiments.pebr`."""

from pyterrier_prob.pebr.cutoff import (
    CDFCutoffRetriever,
    CutoffHits,
    ScoreCutoffRetriever,
    TopKRetriever,
    count_above,
    threshold_search,
)
from pyterrier_prob.pebr.encoders import PARAM_COLUMNS, ProbBiEncoder, ProbDocEncoder, ProbQueryEncoder
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
