"""The faiss search backends, one family per module, each registering itself (:func:`register`); importing this
package registers the built-in ones. A new backend: a module with a :class:`Backend` subclass (and its settings
dataclass) that calls :func:`register`, plus its import line below."""

from pyterrier_prob.index.backends import flat, hnsw, hnsw_sq, ivf  # noqa: F401  (the built-in backends register)
from pyterrier_prob.index.backends.base import (
    Backend,
    SearchSettings,
    build_index,
    get,
    import_faiss,
    names,
    register,
    search_params,
    unregister,
)

__all__ = [
    "Backend",
    "SearchSettings",
    "build_index",
    "get",
    "import_faiss",
    "names",
    "register",
    "search_params",
    "unregister",
]
