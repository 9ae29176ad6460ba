"""pEBR's PyTerrier side (``shared/papers/pebr.md``): encoders that add ``query_vec`` and the per-query law's
parameters, and the CDF / score / top-k cutoff retrievers. The experiment is :mod:`pyterrier_prob.experiments.pebr`."""

from pyterrier_prob.pebr.cutoff import (
    CDFCutoffRetriever,
    CutoffHits,
    ScoreCutoffRetriever,
    TopKRetriever,
    count_above,
    threshold_search,
)
from pyterrier_prob.pebr.encoders import PARAM_COLUMNS, ProbBiEncoder, ProbDocEncoder, ProbQueryEncoder

__all__ = [
    "CDFCutoffRetriever",
    "CutoffHits",
    "PARAM_COLUMNS",
    "ProbBiEncoder",
    "ProbDocEncoder",
    "ProbQueryEncoder",
    "ScoreCutoffRetriever",
    "TopKRetriever",
    "count_above",
    "threshold_search",
]
