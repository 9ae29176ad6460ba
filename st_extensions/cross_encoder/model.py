"""VarCrossEncoder: a CrossEncoder whose score is a Gaussian (``shared/papers/var-cross-encoder.md``, Sec. 3).

``[CLS] q [SEP] d [SEP]`` -> transformer backbone f^B (Eq. 1-2) -> CLS pooling -> :class:`VariationalHead`
(the probabilistic module and the linear ranker, Eq. 3-8). Built from the modules sentence-transformers already
has (``Transformer(..., transformer_task="feature-extraction")``, ``Pooling(d, "cls")``) plus our head, so the
CrossEncoderTrainer, the CE losses (which read ``model(inputs)["scores"]``), evaluators, ``predict`` and
``rank`` all work as for any CrossEncoder; :meth:`VarCrossEncoder.predict` adds ``return_std=True``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from sentence_transformers import CrossEncoder
from sentence_transformers.base.model import BaseModel
from sentence_transformers.base.modules import Transformer
from sentence_transformers.sentence_transformer.modules import Pooling
from sentence_transformers.util import batch_to_device
from torch import nn
from tqdm.autonotebook import trange

from st_extensions.cross_encoder.head import SCORE_VAR_KEY, Variant, VariationalHead
from st_extensions.defaults import default_model_path

HEAD_REFERENCE = f"{VariationalHead.__module__}.{VariationalHead.__name__}"


def find_var_head(model: torch.nn.Module) -> VariationalHead:
    """The model's :class:`VariationalHead`; a clear error when it has none (or several)."""
    heads = [m for m in model.modules() if isinstance(m, VariationalHead)]
    if not heads:
        raise ValueError(
            f"{type(model).__name__} has no VariationalHead: VariationalBCELoss and predict(return_std=True) need "
            "a model built with st_extensions.cross_encoder.build_var_cross_encoder(...) (or loaded with "
            "st_extensions.load_model)"
        )
    if len(heads) > 1:
        raise ValueError(f"model has {len(heads)} VariationalHeads, expected exactly one")
    return heads[0]


def _is_identity(fn: Callable | None) -> bool:
    return fn is None or isinstance(fn, nn.Identity)


class VarCrossEncoder(CrossEncoder):
    """A :class:`~sentence_transformers.CrossEncoder` ending in a :class:`VariationalHead` (VarCrossEncoder, Sec. 3).

    Build one with :func:`build_var_cross_encoder`; load a saved one with :func:`st_extensions.load_model`
    (which picks this class for a model holding a VariationalHead) or ``VarCrossEncoder(path)`` (our head is
    resolved without ``trust_remote_code``; any other foreign module class still needs it).

    Scores are logits s, not probabilities: the default ``activation_fn`` is the identity (the saved one is
    restored on load). ``predict(pairs)`` returns E[s] = mu^T W + b (Eq. 22; the head is in eval mode), and
    ``predict(pairs, return_std=True)`` returns ``(E[s], sqrt(W^T Sigma W))`` (Eq. 22-23).
    """

    _module_classes = {HEAD_REFERENCE: VariationalHead}

    @property
    def num_labels(self) -> int:
        return 1

    def get_default_activation_fn(self) -> Callable:
        return nn.Identity()

    @property
    def head(self) -> VariationalHead:
        """The model's :class:`VariationalHead`."""
        return find_var_head(self)

    def predict(
        self,
        inputs: Sequence[Any] | Any,
        prompt_name: str | None = None,
        prompt: str | None = None,
        batch_size: int = 32,
        show_progress_bar: bool | None = None,
        activation_fn: Callable | None = None,
        apply_softmax: bool | None = False,
        convert_to_numpy: bool = True,
        convert_to_tensor: bool = False,
        device: str | list[str | torch.device] | None = None,
        pool: dict[str, Any] | None = None,
        chunk_size: int | None = None,
        return_std: bool = False,
        **kwargs: Any,
    ) -> Any:
        """:meth:`CrossEncoder.predict <sentence_transformers.CrossEncoder.predict>`, plus ``return_std``.

        Args:
            return_std: also return the standard deviation of each score, sqrt(W^T Sigma W) (Eq. 23). The
                result is then ``(scores, stds)``, both on the logit scale of the Gaussian score s (Eq. 22-23):
                an ``activation_fn`` other than the identity is refused, since it would transform the mean but
                not the spread. Runs in this process (no ``pool`` / device list).
            Other arguments: as for CrossEncoder.predict.

        Returns:
            As CrossEncoder.predict without ``return_std``; with it a pair ``(scores, stds)`` of arrays
            (tensors with ``convert_to_tensor``, lists of scalar tensors with ``convert_to_numpy=False``),
            or a pair of floats for one input pair.
        """
        if not return_std:
            return super().predict(
                inputs,
                prompt_name=prompt_name,
                prompt=prompt,
                batch_size=batch_size,
                show_progress_bar=show_progress_bar,
                activation_fn=activation_fn,
                apply_softmax=apply_softmax,
                convert_to_numpy=convert_to_numpy,
                convert_to_tensor=convert_to_tensor,
                device=device,
                pool=pool,
                chunk_size=chunk_size,
                **kwargs,
            )
        if pool is not None or isinstance(device, list):
            raise ValueError("predict(return_std=True) runs in this process: pass one device, not a pool or a list")
        if not _is_identity(activation_fn if activation_fn is not None else self.activation_fn):
            raise ValueError(
                "predict(return_std=True) returns the mean and standard deviation of the logit s (Eq. 22-23); "
                f"activation_fn {activation_fn if activation_fn is not None else self.activation_fn} would change "
                "the mean but not the spread: pass activation_fn=torch.nn.Identity()"
            )
        if batch_size <= 0:
            raise ValueError(f"batch_size must be a positive integer, got {batch_size}.")
        if show_progress_bar is None:
            show_progress_bar = False
        singular = self.is_singular_input(inputs)
        if singular:
            inputs = [inputs.tolist() if isinstance(inputs, np.ndarray) else inputs]
        elif not isinstance(inputs, list):
            inputs = inputs.tolist() if isinstance(inputs, np.ndarray) else list(inputs)
        prompt = self._resolve_prompt(prompt, prompt_name)
        means, stds = self._inference_with_std(
            inputs, prompt=prompt, batch_size=batch_size, show_progress_bar=show_progress_bar, device=device, **kwargs
        )
        if convert_to_tensor:
            pass
        elif convert_to_numpy:
            means, stds = means.float().cpu().numpy(), stds.float().cpu().numpy()
        else:
            means, stds = list(means), list(stds)
        if singular:
            return means[0], stds[0]
        return means, stds

    @torch.inference_mode()
    def _inference_with_std(
        self,
        inputs: list,
        *,
        prompt: str | None,
        batch_size: int,
        show_progress_bar: bool,
        device: str | torch.device | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """CrossEncoder._inference, reading ``scores`` (E[s]) and ``score_var`` (Var[s]) per batch."""
        device = self._resolve_inference_device(device)
        self.eval()
        if not inputs:
            empty = torch.zeros(0, device=device)
            return empty, empty.clone()
        order = np.argsort([-self._input_length(pair) for pair in inputs])
        if self._can_flatten_inputs():
            order = self._interleave_sorted_indices(order)
        sorted_inputs = [inputs[i] for i in order]
        means, variances = [], []
        for start in trange(0, len(sorted_inputs), batch_size, desc="Batches", disable=not show_progress_bar):
            features = self.preprocess(sorted_inputs[start : start + batch_size], prompt=prompt, **kwargs)
            out = self(batch_to_device(features, device), **kwargs)
            if SCORE_VAR_KEY not in out:
                raise ValueError(f"the model's last module wrote no {SCORE_VAR_KEY!r}: is its head a VariationalHead?")
            means.append(out["scores"].float().reshape(-1))
            variances.append(out[SCORE_VAR_KEY].float().reshape(-1))
        inverse = torch.as_tensor(np.argsort(order), device=device)
        mean = torch.cat(means)[inverse]
        std = torch.sqrt(torch.cat(variances)[inverse].clamp_min(0.0))
        return mean, std


def build_var_cross_encoder(
    base_model: str | BaseModel | None = None,
    variant: Variant = "VAR",
    latent_dim: int | None = None,
    max_seq_length: int | None = None,
    device: str | None = None,
    **head_kwargs: Any,
) -> VarCrossEncoder:
    """A VarCrossEncoder: backbone -> [CLS] -> :class:`VariationalHead` (``VAR``, ``MEANVAR`` or ``MEAN``).

    Args:
        base_model: the backbone f^B: a Hugging Face encoder path or name, a saved sentence-transformers
            model directory (the default: the packaged all-MiniLM-L6-v2), or a loaded model whose first module
            is a feature-extraction ``Transformer`` (copied: the new model shares no weights with it).
        variant: the probabilistic module (Sec. 3.2.1).
        latent_dim: K (``MEANVAR`` only; ``VAR`` and ``MEAN`` need K = hidden size, the default).
        max_seq_length: truncate query + document to this many tokens (default: the backbone's).
        device: where to put the model.
        **head_kwargs: further :class:`VariationalHead` arguments (``bias``, ``init_log_var``, clamps).

    Returns:
        The model; its decoder, variance and mean branches are new, the backbone pre-trained.
    """
    if base_model is None:
        base_model = default_model_path()
    if isinstance(base_model, str):
        transformer = Transformer(base_model, transformer_task="feature-extraction", max_seq_length=max_seq_length)
    elif isinstance(base_model, BaseModel):
        if any(isinstance(m, VariationalHead) for m in base_model.modules()):
            raise ValueError("base_model already has a VariationalHead: pass its backbone (or its path) instead")
        first = base_model[0]
        if not isinstance(first, Transformer) or first.transformer_task != "feature-extraction":
            raise ValueError(
                "base_model's first module must be a feature-extraction Transformer (a SentenceTransformer's "
                f"encoder); got {type(first).__name__}: pass the backbone's path instead"
            )
        transformer = copy.deepcopy(first)
        if max_seq_length is not None:
            transformer.max_seq_length = max_seq_length
    else:
        raise TypeError(f"base_model must be a path/name or a sentence-transformers model, got {type(base_model)}")
    dim = transformer.get_embedding_dimension()
    transformer.auto_model.config.num_labels = 1  # a plain CrossEncoder reading the saved config sees one label
    head = VariationalHead(dim, variant=variant, latent_dim=latent_dim, **head_kwargs)
    return VarCrossEncoder(
        modules=[transformer, Pooling(dim, "cls"), head],
        device=device or (str(base_model.device) if isinstance(base_model, BaseModel) else None),
        activation_fn=nn.Identity(),
    )
