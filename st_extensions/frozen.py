"""Frozen-encoder training: a method's own modules trained on cached encoder outputs, each text encoded once.

:func:`cached_model` encodes every text once with the sentence-transformers prefix and returns a model of
:class:`CachedEmbeddings` and the very same added modules (adapter, pEBR head, ``"heads"`` MoL, UniERF branches),
so training it trains the full model's modules in place.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save
from sentence_transformers import SentenceTransformer
from sentence_transformers.base.modules import InputModule
from torch import Tensor

from st_extensions.atomic import atomic_write, read_checked
from st_extensions.defaults import base_modules
from st_extensions.modules.adapter import LinearAdapter

__all__ = [
    "CachedEmbeddings",
    "build_adapter_model",
    "cached_model",
    "encode_prefix",
    "evaluating",
    "frozen_prefix_length",
    "prefix_model",
]


class CachedEmbeddings(InputModule):
    """Input module standing in for a frozen encoder prefix: writes each text's cached pooled embedding as
    ``sentence_embedding``; unknown texts are encoded by ``encoder`` and added (without one: ``KeyError``). Not savable.
    """

    save_in_root = False

    def __init__(self, texts: Sequence[str], embeddings: Tensor, encoder: SentenceTransformer | None = None) -> None:
        super().__init__()
        if len(texts) != len(embeddings):
            raise ValueError(f"{len(texts)} texts but {len(embeddings)} embeddings")
        self.index = {t: i for i, t in enumerate(texts)}
        self.register_buffer("table", embeddings.detach().clone(), persistent=False)
        self.encoder = [encoder]  # in a list: not a registered submodule (its weights are not this module's)

    @property
    def modalities(self) -> list[str]:
        return ["text"]

    def preprocess(self, inputs: Sequence[Any], prompt: str | None = None, **kwargs) -> dict[str, Tensor]:
        if prompt:
            raise ValueError("CachedEmbeddings holds embeddings of texts without prompts; got a prompt")
        inputs = list(inputs)
        if self.encoder[0] is not None and (new := self.missing(inputs)):
            self.extend(new, self.encode_new(new))
        try:
            ids = [self.index[t] for t in inputs]
        except KeyError as e:
            text = repr(e.args[0])[:80]
            raise KeyError(f"text not in the frozen-encoder cache (was it in the training data?): {text}") from None
        ids_t = torch.tensor(ids, dtype=torch.long)[:, None]
        return {"input_ids": ids_t, "attention_mask": torch.ones_like(ids_t)}

    def forward(self, features: dict[str, Any], **kwargs) -> dict[str, Any]:
        features["sentence_embedding"] = self.table[features["input_ids"][:, 0].to(self.table.device)]
        return features

    def encode_new(self, texts: Sequence[str]) -> Tensor:
        """The embeddings of ``texts`` by ``encoder`` (the frozen prefix)."""
        return _encode(self.encoder[0], texts)

    def missing(self, texts: Sequence[str]) -> list[str]:
        """The distinct texts of ``texts`` that are not cached yet."""
        return [t for t in dict.fromkeys(texts) if t not in self.index]

    def extend(self, texts: Sequence[str], embeddings: Tensor) -> None:
        """Add ``texts`` (not yet cached, distinct) and their embeddings."""
        if len(texts) != len(embeddings):
            raise ValueError(f"{len(texts)} texts but {len(embeddings)} embeddings")
        for t in texts:
            self.index[t] = len(self.index)
        self.table = torch.cat([self.table, embeddings.to(self.table)])

    def save_cache(self, path: str) -> None:
        """Write the cache to ``path`` (safetensors: the table, and the texts as JSON metadata), atomically."""
        texts = sorted(self.index, key=self.index.get)
        data = save({"table": self.table.contiguous()}, metadata={"texts": json.dumps(texts)})
        atomic_write(path, lambda f: f.write(data))

    @classmethod
    def load_cache(cls, path: str) -> CachedEmbeddings:
        """Read a cache written by :meth:`save_cache` (safetensors, never pickle); ``CorruptFileError`` naming
        a truncated or corrupted file."""
        return cls(*read_checked(path, _read_cache, "delete it: the cache is rebuilt on the next run"))

    def save(self, output_path: str, *args, **kwargs) -> None:
        raise NotImplementedError("CachedEmbeddings is a training-time stand-in: save the full model instead")

    def __repr__(self) -> str:
        return f"CachedEmbeddings({len(self.index)} texts, dim={self.table.shape[-1]})"


def _read_cache(path: str) -> tuple[list[str], Tensor]:
    with safe_open(path, framework="pt") as f:
        texts, table = json.loads(f.metadata()["texts"]), f.get_tensor("table")
    if len(texts) != len(table):
        raise ValueError(f"{len(texts)} texts but {len(table)} rows")
    return texts, table


def frozen_prefix_length(model: SentenceTransformer, require_added: bool = True) -> int:
    """Number of leading modules (the encoder) before the first module a method added (``require_added=False``: all of
    a model without one). ValueError: nothing to train, no prefix, or an added module reading token outputs."""
    modules = list(model)
    k = 0
    while k < len(modules) and type(modules[k]).__module__.startswith("sentence_transformers"):
        k += 1
    if k == 0 or (k == len(modules) and require_added):
        names = [type(m).__name__ for m in modules]
        raise ValueError(
            f"frozen-encoder training needs an encoder prefix followed by added modules, got modules {names}"
        )
    if any(getattr(m, "component_source", None) == "tokens" for m in modules[k:]):
        raise ValueError(
            "a MixtureOfLogits with component_source='tokens' reads the encoder's token outputs: frozen-encoder "
            "training needs component_source='heads'"
        )
    return k


@contextlib.contextmanager
def evaluating(*modules: torch.nn.Module) -> Iterator[None]:
    """``modules`` in eval mode for the block, each put back in its own mode afterwards."""
    modes = [m.training for m in modules]
    for m in modules:
        m.eval()
    try:
        yield
    finally:
        for m, mode in zip(modules, modes):
            m.train(mode)


def _encode(prefix: SentenceTransformer, texts: Sequence[str], batch_size: int = 64, show: bool = False) -> Tensor:
    with evaluating(prefix), torch.inference_mode():
        out = prefix.encode(list(texts), batch_size=batch_size, convert_to_tensor=True, show_progress_bar=show)
    return out.float().cpu().clone()


def prefix_model(model: SentenceTransformer, require_added: bool = True) -> SentenceTransformer:
    """The encoder prefix of ``model`` as a SentenceTransformer sharing its modules."""
    k = frozen_prefix_length(model, require_added=require_added)
    return SentenceTransformer(modules=list(model)[:k], device=str(model.device))


def encode_prefix(
    model: SentenceTransformer, texts: Sequence[str], batch_size: int = 64, show_progress_bar: bool = False
) -> Tensor:
    """The encoder prefix's pooled embeddings of ``texts`` (eval mode), ``(len(texts), dim)`` float32 on CPU."""
    return _encode(prefix_model(model, require_added=False), texts, batch_size, show_progress_bar)


def cached_model(
    model: SentenceTransformer,
    texts: Sequence[str] = (),
    batch_size: int = 64,
    show_progress_bar: bool = False,
    cache: CachedEmbeddings | None = None,
) -> SentenceTransformer:
    """A model of :class:`CachedEmbeddings` for ``texts`` and ``model``'s added modules (shared, not copied).

    ``cache``: one from this model's encoder prefix to reuse and extend (another encoder's gives wrong results). Texts
    not cached are encoded by ``model``'s prefix on first use."""
    prefix = prefix_model(model, require_added=False)
    cache = CachedEmbeddings([], torch.zeros(0), encoder=prefix) if cache is None else cache
    if cache.encoder[0] is None:
        cache.encoder[0] = prefix
    if new := cache.missing(texts):
        cache.extend(new, _encode(prefix, new, batch_size, show_progress_bar))
    return SentenceTransformer(modules=[cache, *list(model)[len(prefix) :]], device=str(model.device))


def build_adapter_model(
    base_model: str | SentenceTransformer | None = None, device: str | None = None
) -> SentenceTransformer:
    """The dot-product baseline of the frozen-encoder recipe: ``base_model`` + :class:`LinearAdapter` (a residual,
    zero-initialised linear map shared by queries and documents), which starts exactly as ``base_model``."""
    modules, dim, device = base_modules(base_model, device)
    return SentenceTransformer(modules=[*modules, LinearAdapter(dim)], device=device)
