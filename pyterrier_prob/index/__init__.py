"""On-disk artifacts: the dense vector index (a pyterrier-dr FlexIndex) and the MoL component index.

Both are written through one atomic writer (:mod:`pyterrier_prob.atomic`, via :class:`AtomicIndexer`).
"""

from pyterrier_prob.index.dense import DenseIndex, DenseIndexer, as_dense_index
from pyterrier_prob.index.indexer import AtomicIndexer, IndexingMode
from pyterrier_prob.index.mol import MoLIndex, MoLIndexer, as_mol_index

__all__ = [
    "AtomicIndexer",
    "DenseIndex",
    "DenseIndexer",
    "IndexingMode",
    "MoLIndex",
    "MoLIndexer",
    "as_dense_index",
    "as_mol_index",
]
