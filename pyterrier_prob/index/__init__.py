"""On-disk artifacts and the one search layer over them: the dense (:mod:`.dense`, a FlexIndex) and MoL (:mod:`.mol`)
indexes written atomically (:class:`AtomicIndexer`), the exact scan ``S_{t,K}`` (:mod:`.exact`, pEBR Appendix A) and the
:class:`Searcher` backends -- exact, faiss IVF / HNSW / GPU, shards -- of every ``searcher=`` (:mod:`.search`)."""

from pyterrier_prob.index.dense import DenseIndex, DenseIndexer, as_dense_index
from pyterrier_prob.index.exact import CutoffHits, count_above, docnos_of, threshold_search
from pyterrier_prob.index.indexer import AtomicIndexer, IndexingMode
from pyterrier_prob.index.mol import MoLIndex, MoLIndexer, as_mol_index
from pyterrier_prob.index.search import (
    BACKENDS,
    ExactSearcher,
    FaissSearcher,
    Searcher,
    SearchSettings,
    ShardedSearcher,
    check_searcher,
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
    "SearchSettings",
    "Searcher",
    "ShardedSearcher",
    "as_dense_index",
    "as_mol_index",
    "check_searcher",
    "count_above",
    "docnos_of",
    "hits_from_pairs",
    "import_faiss",
    "make_searcher",
    "merge_runs",
    "threshold_search",
]
