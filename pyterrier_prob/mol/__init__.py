"""Mixture-of-Logits' PyTerrier side (``shared/papers/mixture-of-logits.txt``): the component encoder, the exact and
approximate top-K retriever and the re-ranker; the component index is :class:`pyterrier_prob.index.MoLIndex`. The
experiment is :mod:`pyterrier_prob.experiments.mol`."""

from pyterrier_prob.index.mol import MoLIndex, MoLIndexer, as_mol_index
from pyterrier_prob.mol.encoder import MoLDocEncoder, MoLEncoder, MoLQueryEncoder
from pyterrier_prob.mol.retrieval import METHODS, MoLRetriever, MoLRunOptions
from pyterrier_prob.mol.scoring import MoLReranker

__all__ = [
    "METHODS",
    "MoLDocEncoder",
    "MoLEncoder",
    "MoLIndex",
    "MoLIndexer",
    "MoLQueryEncoder",
    "MoLReranker",
    "MoLRetriever",
    "MoLRunOptions",
    "as_mol_index",
]
