"""What a faiss search backend is (:class:`Backend`), its settings (:class:`SearchSettings`), the registry that
:func:`~pyterrier_prob.index.search.make_searcher` looks backends up in (:func:`register`, :func:`get`) and the one
builder of a faiss index (:func:`build_index`). A backend family lives in one file of this package with its own
settings dataclass (pyterrier-dr's ``flex/`` is the model); adding one is a new file and one registration."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import pyterrier as pt

from pyterrier_prob.validation import choice, finite_float, positive_int

__all__ = [
    "ADD_BATCH",
    "Backend",
    "SearchSettings",
    "build_index",
    "check_search_params",
    "get",
    "import_faiss",
    "names",
    "own_quantizer",
    "register",
    "scaled_rows",
    "search_params",
    "settings_for",
    "unregister",
]

ADD_BATCH = 65536  # vectors added to a faiss index at once (a backend may add all at once: Backend.add_batch)


@dataclass(frozen=True)
class SearchSettings:
    """The settings every faiss backend has: the training sample's ``seed`` (part of the cache name) and the search
    parameters ``rescore`` (re-score candidates from the exact vectors; None: when the codes are lossy and the vectors
    at hand), ``range_slack`` and ``k_factor`` (``docs/scale.md``). A backend family's settings subclass this; its
    ``search_params`` are the fields a search may change (:meth:`FaissSearcher.with_params`), the rest build it."""

    search_params: ClassVar[tuple[str, ...]] = ("rescore", "range_slack", "k_factor")

    seed: int = 0
    rescore: bool | None = None
    range_slack: float = 0.0
    k_factor: int = 1

    def checked(self, lossy: bool, has_vectors: bool) -> SearchSettings:
        """These settings with the common search parameters checked (``rescore=None``: re-score lossy codes when
        the vectors are at hand); a subclass checks its own too."""
        rescore = (lossy and has_vectors) if self.rescore is None else bool(self.rescore)
        if rescore and not has_vectors:
            raise ValueError("rescore=True needs the exact vectors (vectors=...)")
        return dataclasses.replace(
            self,
            rescore=rescore,
            range_slack=finite_float("range_slack", self.range_slack),
            k_factor=positive_int("k_factor", self.k_factor),
        )


class Backend:
    """One faiss index type: ``name``, its ``settings`` class, whether its codes are ``lossy`` (re-scored from the
    exact vectors by default) and whether faiss has a ``gpu`` version. A subclass implements :meth:`create` (the
    untrained index) and, where it has build defaults or search parameters, :meth:`with_defaults`, :meth:`apply`
    and :meth:`describe`; :meth:`range_pairs` may replace the per-query range search."""

    name: str = ""
    settings: type[SearchSettings] = SearchSettings
    lossy: bool = False
    gpu: bool = True
    add_batch: int | None = ADD_BATCH  # None: every vector in one add

    def with_defaults(self, s: SearchSettings, n: int, d: int) -> tuple[SearchSettings, dict[str, Any]]:
        """``s`` with the size-dependent defaults filled in, and the build parameters naming the cached index."""
        return s, {}

    def create(self, faiss: Any, d: int, s: SearchSettings) -> Any:  # pragma: no cover - abstract
        """The (untrained) faiss index of dimension ``d`` for inner products."""
        raise NotImplementedError

    def check(self, s: SearchSettings, has_vectors: bool) -> SearchSettings:
        """``s`` (of :attr:`settings`) with its search parameters checked."""
        return s.checked(self.lossy, has_vectors)

    def apply(self, index: Any, s: SearchSettings, k: int) -> None:
        """Set the search parameters on ``index`` before a search of depth ``k`` (0: a range search)."""

    def describe(self, index: Any, s: SearchSettings) -> list[str]:
        """The backend's own search parameters as ``name=value`` strings (:meth:`FaissSearcher.setting`)."""
        return []

    def range_pairs(self, searcher: Any, Q: np.ndarray, t: np.ndarray, radius: np.ndarray) -> list | None:
        """The range search's ``[(scores, ids)]`` per query, or None for the default (faiss ``range_search``)."""
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


_REGISTRY: dict[str, Backend] = {}


def register(backend: Backend) -> Backend:
    """Add ``backend`` to the registry under its name (a name already taken by another backend is a ValueError)."""
    name = str(backend.name)
    if not name or name == "exact":
        raise ValueError(f"a backend needs a name other than '' and 'exact' (the exact scan), got {name!r}")
    if name in _REGISTRY and type(_REGISTRY[name]) is not type(backend):
        raise ValueError(f"backend {name!r} is already registered ({_REGISTRY[name]!r})")
    if not (isinstance(backend.settings, type) and issubclass(backend.settings, SearchSettings)):
        raise TypeError(f"{backend!r}.settings must be a SearchSettings subclass, got {backend.settings!r}")
    _REGISTRY[name] = backend
    return backend


def unregister(name: str) -> None:
    """Remove the backend ``name`` from the registry (nothing when it is not there)."""
    _REGISTRY.pop(str(name), None)


def names() -> tuple[str, ...]:
    """The registered backends' names, in registration order."""
    return tuple(_REGISTRY)


def get(name: str) -> Backend:
    """The registered backend ``name`` (a ValueError naming the registered ones otherwise)."""
    choice("backend", name, ("exact", *_REGISTRY))
    if name == "exact":
        raise ValueError("'exact' is the exact scan (ExactSearcher), not a faiss backend")
    return _REGISTRY[name]


def search_params() -> tuple[str, ...]:
    """Every registered backend's search parameters (their union, in order)."""
    return tuple(dict.fromkeys(p for b in _REGISTRY.values() for p in b.settings.search_params))


def import_faiss() -> Any:
    """``import faiss`` with an error that says how to install it, and a warning when two builds are installed."""
    try:
        import faiss
    except ImportError as e:
        raise ImportError(
            'faiss is not installed: pip install "pyterrier-prob[cpu]" (faiss-cpu) or "pyterrier-prob[gpu]" '
            "(faiss-gpu, for a CUDA machine); install one of them, not both"
        ) from e
    if not getattr(import_faiss, "_checked", False):  # once per process: the distributions that installed 'faiss'
        import_faiss._checked = True  # type: ignore[attr-defined]
        builds = sorted(set(importlib.metadata.packages_distributions().get("faiss", [])))
        if len(builds) > 1:
            warnings.warn(
                f"several faiss builds are installed ({', '.join(builds)}): they write the same 'faiss' package over "
                "each other; uninstall all of them and install one (pyterrier-prob[cpu] or pyterrier-prob[gpu])",
                stacklevel=2,
            )
    return faiss


def scaled_rows(vectors: np.ndarray, rows: Any, scale: np.ndarray | None) -> np.ndarray:
    """``vectors[rows]`` as contiguous float32, each times its ``scale`` when given."""
    x = np.ascontiguousarray(np.asarray(vectors[rows], dtype=np.float32))
    return x if scale is None else x * scale[rows][:, None]


def build_index(
    vectors: np.ndarray, backend: str | Backend, scale: np.ndarray | None, s: SearchSettings, verbose: bool = False
) -> Any:
    """A faiss index of ``backend`` over ``vectors`` (times ``scale``), trained on a seeded sample of
    ``s.train_size`` rows (all when the settings have none) if it needs training; ``s``: settings with their defaults
    filled (:meth:`Backend.with_defaults`)."""
    b = get(backend) if isinstance(backend, str) else backend
    faiss = import_faiss()
    n, d = vectors.shape
    index = b.create(faiss, d, s)
    if not index.is_trained:
        size = min(n, int(getattr(s, "train_size", None) or n))
        rows = np.sort(np.random.default_rng(s.seed).choice(n, size=size, replace=False))
        index.train(scaled_rows(vectors, rows, scale))
    step = max(n, 1) if b.add_batch is None else b.add_batch
    for a in pt.tqdm(range(0, n, step), desc=f"building {b.name}", unit="batch", disable=not verbose):
        index.add(scaled_rows(vectors, slice(a, a + step), scale))
    return index


def own_quantizer(index: Any, quantizer: Any) -> Any:
    """``index`` made the owner of its coarse ``quantizer`` (faiss' Python objects otherwise free it first)."""
    index.own_fields = True
    quantizer.this.disown()
    return index


def settings_for(backend: Backend, settings: SearchSettings | None, params: dict[str, Any]) -> SearchSettings:
    """The backend's settings from ``settings`` (its own class, or the base class's common fields) and ``params``
    (its fields by keyword; an unknown one is a ValueError naming the backend's)."""
    fields = [f.name for f in dataclasses.fields(backend.settings)]
    if unknown := sorted(set(params) - set(fields)):
        raise ValueError(f"unknown parameter {unknown[0]!r} of the {backend.name} backend ({', '.join(fields)})")
    if settings is None:
        base = backend.settings()
    elif isinstance(settings, backend.settings):
        base = settings
    elif type(settings) is SearchSettings:
        base = backend.settings(**dataclasses.asdict(settings))
    else:
        want = backend.settings.__name__
        raise TypeError(f"settings for the {backend.name} backend must be {want}, got {settings!r}")
    return dataclasses.replace(base, **params)


def check_search_params(backend: Backend, params: Sequence[str]) -> None:
    """A ValueError naming a parameter that is not one of the backend's search parameters."""
    if unknown := sorted(set(params) - set(backend.settings.search_params)):
        raise ValueError(
            f"unknown search parameter {unknown[0]!r} of the {backend.name} backend "
            f"({', '.join(backend.settings.search_params)})"
        )
