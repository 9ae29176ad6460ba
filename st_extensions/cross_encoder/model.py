"""VarCrossEncoder (``shared/papers/var-cross-encoder.md``, Sec. 3): ``[CLS] q [SEP] d [SEP]`` -> backbone (Eq. 1-2) ->
CLS pooling -> :class:`VariationalHead` (Eq. 3-8): stock sentence-transformers modules plus our head, so trainer,
losses, ``predict`` and ``rank`` work as for any CrossEncoder; ``predict`` adds ``return_std=True``."""

from __future__ import annotations

import copy
import inspect
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

from st_extensions.checks import positive_int
from st_extensions.cross_encoder.head import SCORE_VAR_KEY, Variant, VariationalHead
from st_extensions.defaults import default_model_path, find_module
from st_extensions.frozen import evaluating
from st_extensions.loading import register_module
from st_extensions.partial import (
    check_layers,
    check_partial_transformer,
    longest_first,
    pair_key,
    run_top_layers,
    state_fingerprint,
    states_entering,
)


def find_var_head(model: torch.nn.Module) -> VariationalHead:
    """The model's :class:`VariationalHead`; a clear error when it has none (or several)."""
    needed_by = "VariationalBCELoss and predict(return_std=True) need"
    return find_module(model, VariationalHead, needed_by, "cross_encoder.build_var_cross_encoder")


class VarCrossEncoder(CrossEncoder):
    """A :class:`~sentence_transformers.CrossEncoder` ending in a :class:`VariationalHead` (VarCrossEncoder, Sec. 3),
    loaded by :func:`st_extensions.load_model` or ``VarCrossEncoder(path)``. Its scores are logits; ``predict`` returns
    E[s] = mu^T W + b (Eq. 22), with ``return_std=True`` also sqrt(W^T Sigma W) (Eq. 23)."""

    _module_classes = {f"{VariationalHead.__module__}.{VariationalHead.__name__}": VariationalHead}

    @property
    def num_labels(self) -> int:
        return 1

    def get_default_activation_fn(self) -> Callable:
        return nn.Identity()

    @property
    def head(self) -> VariationalHead:
        """The model's :class:`VariationalHead`."""
        return find_var_head(self)

    def predict(self, inputs: Sequence[Any] | Any, *args: Any, return_std: bool = False, **kwargs: Any) -> Any:
        """As :meth:`CrossEncoder.predict <sentence_transformers.CrossEncoder.predict>`; ``return_std``: ``(scores,
        stds)`` (Eq. 22-23, logits; floats for one pair), refused with a non-identity ``activation_fn``, pool or
        devices."""
        if not return_std:
            return super().predict(inputs, *args, **kwargs)
        call = inspect.signature(CrossEncoder.predict).bind(self, inputs, *args, **kwargs)
        call.apply_defaults()
        arg = call.arguments  # CrossEncoder.predict's arguments by name, defaults filled in
        if arg["pool"] is not None or isinstance(arg["device"], list):
            raise ValueError("predict(return_std=True) runs in this process: pass one device, not a pool or a list")
        activation_fn = arg["activation_fn"] if arg["activation_fn"] is not None else self.activation_fn
        if not isinstance(activation_fn, nn.Identity | None):
            raise ValueError(
                f"predict(return_std=True) gives the mean and std of the logit s (Eq. 22-23), which activation_fn "
                f"{activation_fn} would distort: pass activation_fn=torch.nn.Identity()"
            )
        positive_int("batch_size", arg["batch_size"])
        singular = self.is_singular_input(inputs)
        inputs = inputs.tolist() if isinstance(inputs, np.ndarray) else inputs
        means, stds = self._inference_with_std([inputs] if singular else list(inputs), arg)
        if not arg["convert_to_tensor"]:
            means, stds = (t.float().cpu().numpy() if arg["convert_to_numpy"] else list(t) for t in (means, stds))
        return (means[0], stds[0]) if singular else (means, stds)

    @torch.inference_mode()
    def _inference_with_std(self, inputs: list, arg: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """CrossEncoder._inference under ``predict``'s arguments ``arg``, reading ``scores`` (E[s]) and ``score_var``
        (Var[s]) per batch."""
        device, kwargs = self._resolve_inference_device(arg["device"]), arg["kwargs"]
        prompt, batch_size = self._resolve_prompt(arg["prompt"], arg["prompt_name"]), arg["batch_size"]
        self.eval()
        if not inputs:
            return torch.zeros(0, device=device), torch.zeros(0, device=device)
        order = np.argsort([-self._input_length(pair) for pair in inputs])
        if self._can_flatten_inputs():
            order = self._interleave_sorted_indices(order)
        sorted_inputs = [inputs[i] for i in order]
        means, variances = [], []
        for start in trange(0, len(sorted_inputs), batch_size, desc="Batches", disable=not arg["show_progress_bar"]):
            features = self.preprocess(sorted_inputs[start : start + batch_size], prompt=prompt, **kwargs)
            out = self(batch_to_device(features, device), **kwargs)
            if SCORE_VAR_KEY not in out:
                raise ValueError(f"the model's last module wrote no {SCORE_VAR_KEY!r}: is its head a VariationalHead?")
            means.append(out["scores"].float().reshape(-1))
            variances.append(out[SCORE_VAR_KEY].float().reshape(-1))
        inverse = torch.as_tensor(np.argsort(order), device=device)
        return torch.cat(means)[inverse], torch.sqrt(torch.cat(variances)[inverse].clamp_min(0.0))


register_module(VariationalHead, model_class=VarCrossEncoder)


def build_var_cross_encoder(
    base_model: str | BaseModel | None = None,
    variant: Variant = "VAR",
    latent_dim: int | None = None,
    max_seq_length: int | None = None,
    device: str | None = None,
    **head_kwargs: Any,
) -> VarCrossEncoder:
    """A VarCrossEncoder: backbone -> [CLS] -> a new :class:`VariationalHead` (``variant``, ``latent_dim`` K for
    MEANVAR, ``**head_kwargs``); ``base_model``: an encoder name / path, a sentence-transformers folder (default the
    packaged all-MiniLM-L6-v2) or a loaded model (copied); ``max_seq_length``: of query + document."""
    base_model = default_model_path() if base_model is None else base_model
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


def predict_sharing_layers(
    models: Sequence[CrossEncoder],
    pairs: Sequence[Any],
    frozen_layers: int,
    *,
    batch_size: int = 32,
    show_progress_bar: bool = False,
) -> list[tuple[np.ndarray, np.ndarray | None]]:
    """Score ``pairs`` with cross-encoders sharing their embeddings and lower ``frozen_layers`` layers (same
    :func:`state_fingerprint`), running the shared layers once per batch: per model ``(scores, stds)`` float32 in pair
    order (``stds`` None without a score variance), its ``predict`` logits up to float rounding."""
    models = list(models)
    if not models:
        raise ValueError("predict_sharing_layers needs at least one model")
    positive_int("batch_size", batch_size)
    transformers = [list(m)[0] for m in models]
    num_layers = len(check_partial_transformer(transformers[0]).encoder.layer)
    frozen = check_layers("frozen_layers", frozen_layers, 0, num_layers - 1, num_layers)
    prints = [state_fingerprint(t, frozen) for t in transformers]  # also checks every model can be split
    if differ := [i for i, p in enumerate(prints) if p != prints[0]]:
        raise ValueError(
            f"models {differ} do not share the embeddings, lower {frozen} layers, tokenizer or settings of model 0: "
            "score them separately"
        )
    keys = [pair_key(p) for p in pairs]
    n = len(keys)
    scores = [np.empty(n, np.float32) for _ in models]
    variances: list[np.ndarray | None] = [None] * len(models)
    with evaluating(*models), torch.inference_mode():
        for idx in longest_first(keys, batch_size, "scoring", show_progress_bar):
            features = batch_to_device(transformers[0].preprocess([keys[i] for i in idx]), models[0].device)
            hidden = states_entering(transformers[0], dict(features), frozen)
            for j, (model, t) in enumerate(zip(models, transformers)):
                out = dict(features)
                out[t.module_output_name] = run_top_layers(t.auto_model, hidden, features["attention_mask"], frozen)
                for module in list(model)[1:]:
                    out = module(out)
                scores[j][idx] = out["scores"].float().reshape(-1).cpu().numpy()
                if SCORE_VAR_KEY in out:
                    if variances[j] is None:
                        variances[j] = np.empty(n, np.float32)
                    variances[j][idx] = out[SCORE_VAR_KEY].float().reshape(-1).cpu().numpy()
    return [(s, None if v is None else np.sqrt(np.clip(v, 0.0, None))) for s, v in zip(scores, variances)]
