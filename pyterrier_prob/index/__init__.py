"""On-disk artifacts and the one search layer over them.

* :mod:`.dense`: the dense vector index (a pyterrier-dr FlexIndex) and :mod:`.mol`: the MoL component index, both
  written through one atomic writer (:mod:`pyterrier_prob.atomic`, via :class:`AtomicIndexer`);
* :mod:`.exact`: the exact blocked scan ``Top_K({d : <q, d> >= t_q})`` (pEBR Appendix A's ``S_{t,K}``), the
  reference;
* :mod:`.search`: :class:`Searcher` backends -- exact, faiss IVF (flat / fp16 / SQ8 / PQ), HNSW, GPU -- with top-k and
  per-query range search, shards and the merge of per-shard runs. pEBR's cutoffs, MoL's candidate stages and UniERF's
  branches all search through it.
"""

from pyterrier_prob.index.dense import DenseIndex, DenseIndexer, as_dense_index
from pyterrier_prob.index.exact import CutoffHits, count_above, docnos_of, threshold_search
from pyterrier_prob.index.indexer import AtomicIndexer, IndexingMode
from pyterrier_prob.index.mol import MoLIndex, MoLIndexer, as_mol_index
from pyterrier_prob.index.search import (
    BACKENDS,
    ExactSearcher,
    FaissSearcher,
    Searcher,
    ShardedSearcher,
    hits_from_pairs,
    import_faiss,
    make_searcher,
    merge_runs,
)

__all__ = [
    "BACKENDS",
    "AtomicIndexer",
    "CutoffHits",
    "DenseIndex",
    "DenseIndexer",
    "ExactSearcher",
    "FaissSearcher",
    "IndexingMode",
    "MoLIndex",
    "MoLIndexer",
    "Searcher",
    "ShardedSearcher",
    "as_dense_index",
    "as_mol_index",
    "count_above",
    "docnos_of",
    "hits_from_pairs",
    "import_faiss",
    "make_searcher",
    "merge_runs",
    "threshold_search",
]
