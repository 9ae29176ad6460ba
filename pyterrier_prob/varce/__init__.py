"""VarCrossEncoder's PyTerrier side (``shared/papers/var-cross-encoder.md``): the uncertainty-aware re-ranker, the six
query perturbations, the hard-query analysis; the analyses of re-ranked runs (:mod:`.analysis`), scoring
(:mod:`.scoring`), calibration and distillation. The experiment is :mod:`pyterrier_prob.experiments.varce`."""

from pyterrier_prob.varce.hard_queries import hard_queries, hard_query_table, no_relevant_in_top, per_query, percent_no
from pyterrier_prob.varce.noise import NOISE_TYPES, QueryNoise, all_noise
from pyterrier_prob.varce.rerank import VarCrossEncoderReranker, risk_adjusted

__all__ = [
    "NOISE_TYPES",
    "QueryNoise",
    "VarCrossEncoderReranker",
    "all_noise",
    "hard_queries",
    "hard_query_table",
    "no_relevant_in_top",
    "per_query",
    "percent_no",
    "risk_adjusted",
]
