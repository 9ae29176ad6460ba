"""Partial fine-tuning: the top N transformer layers train on the lower layers' hidden states, computed once per text.

A model here starts with a sentence-transformers ``Transformer`` whose backbone is a BERT encoder (``BertModel``, L
layers), e.g. [Transformer, Pooling, Normalize, added modules...] or a cross-encoder [Transformer, Pooling(cls), head].
Under the partial recipe the embeddings and the lower L - N layers stay frozen: :class:`LayerStateCache` runs them
once per distinct text (or (query, document) pair for a cross-encoder), in eval mode, and stores the hidden states
*entering* layer L - N, padding dropped, as one ragged fp16 file on disk (a ``np.memmap``) with an index.
:func:`partial_model` returns a training stand-in whose input module, :class:`PartialTransformer`, rebuilds a padded
batch from that cache and runs the top N layers of the very same ``Transformer`` module (shared, not copied), writing
``token_embeddings`` and ``attention_mask`` as the ``Transformer`` would; the pooling and the added modules follow,
also shared. Training the stand-in with the usual trainer, losses and batch sampler trains the real model in place;
the model then saves, loads and encodes as any sentence-transformers model: no cache is needed.

Differences from full training with the lower layers frozen, by construction: the frozen part runs in eval mode
(no dropout in the embeddings and lower layers; the top layers keep their dropout in training), and the top layers
read the fp16-rounded states (``dtype="float32"`` stores them exactly, at twice the disk).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
import time
import weakref
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
from sentence_transformers import CrossEncoder, SentenceTransformer
from sentence_transformers.base.model import BaseModel
from sentence_transformers.base.modules import InputModule, Transformer
from torch import Tensor

from st_extensions.atomic import atomic_write

__all__ = [
    "LayerStateCache",
    "PartialTransformer",
    "check_partial_transformer",
    "layer_attention_mask",
    "partial_model",
    "predict_sharing_layers",
    "run_top_layers",
    "state_fingerprint",
]

FORMAT = "st_extensions.partial/layer-states"
VERSION = 1
META = "meta.json"
STATES = "states.bin"
TOKENS = "tokens.bin"
KEYS = "keys.bin"
ROWS = "rows.bin"
INDEX = "index.json"
DATA_FILES = (STATES, TOKENS, KEYS, ROWS)
LOCK = ".lock"
DTYPES = ("float16", "float32")

Key = str | tuple[str, str]


# ---------------------------------------------------------------------------------------------------------- checks


def check_partial_transformer(module: Any) -> Any:
    """Check that ``module`` (a model's first module) is a ``Transformer`` the partial recipe can split, and return
    its backbone (a ``transformers`` ``BertModel``).

    Raises:
        ValueError: ``module`` is not a sentence-transformers ``Transformer`` (e.g. a ``Router``), not a torch
            feature-extraction text model writing ``token_embeddings`` from ``last_hidden_state`` (a
            sequence-classification CrossEncoder keeps its classifier inside the backbone: build a cross-encoder
            with a separate head, ``st_extensions.cross_encoder.frozen.build_cross_encoder`` or
            ``build_var_cross_encoder``), its backbone is not a ``BertModel`` encoder (decoders, cross-attention and
            other architectures are not handled), its inputs are unpadded (flash-attention flattening), padded on
            the left, or tokenised per task (``query_length`` / ``document_length`` / ``query_expansion``), or it
            returns every layer's hidden states.
    """
    from transformers.models.bert.modeling_bert import BertModel

    if not isinstance(module, Transformer):
        raise ValueError(
            "partial training needs a model whose first module is a sentence-transformers Transformer, got "
            f"{type(module).__name__}"
        )
    params = module.modality_config.get("text") or {}
    if (
        module.backend != "torch"
        or module.transformer_task != "feature-extraction"
        or module.module_output_name != "token_embeddings"
        or params.get("method") != "forward"
        or params.get("method_output_name") not in ("last_hidden_state", ["last_hidden_state"], ("last_hidden_state",))
    ):
        raise ValueError(
            "partial training needs a torch feature-extraction Transformer writing 'token_embeddings' from the "
            f"encoder's last_hidden_state; got backend={module.backend!r}, "
            f"transformer_task={module.transformer_task!r}, module_output_name={module.module_output_name!r}, "
            f"text modality {params!r} (a sequence-classification CrossEncoder has no separate head: build one with "
            "st_extensions.cross_encoder.frozen.build_cross_encoder or build_var_cross_encoder)"
        )
    backbone = module.auto_model
    if not isinstance(backbone, BertModel):
        raise ValueError(
            f"partial training handles BERT encoders (transformers' BertModel), got {type(backbone).__name__}"
        )
    config = backbone.config
    if config.is_decoder or getattr(config, "add_cross_attention", False):
        raise ValueError("partial training handles bidirectional BERT encoders, not decoders or cross-attention")
    if getattr(config, "output_hidden_states", False):
        raise ValueError("partial training cannot give every layer's hidden states: set output_hidden_states=False")
    if getattr(module, "can_flatten_inputs", False):
        raise ValueError("partial training needs padded inputs: set the Transformer's unpad_inputs=False")
    tokenizer = module.tokenizer
    if tokenizer is None:
        raise ValueError("partial training needs a Transformer with a tokenizer")
    if getattr(tokenizer, "padding_side", "right") != "right":
        raise ValueError(f"partial training needs right padding, the tokenizer pads on the {tokenizer.padding_side}")
    per_task = {k: getattr(module, k, None) for k in ("query_length", "document_length", "query_expansion")}
    if any(v is not None for v in per_task.values()):
        raise ValueError(
            f"partial training caches one tokenisation per text; the Transformer tokenises per task: {per_task}"
        )
    return backbone


def _num_layers(backbone: Any) -> int:
    return len(backbone.encoder.layer)


def _check_train_layers(train_layers: Any, num_layers: int) -> int:
    if isinstance(train_layers, bool) or not isinstance(train_layers, (int, np.integer)):
        raise ValueError(f"train_layers must be an int in 1..{num_layers} (the model has L={num_layers} layers)")
    if not 1 <= int(train_layers) <= num_layers:
        raise ValueError(
            f"train_layers must be in 1..{num_layers} (the model has L={num_layers} layers), got {train_layers}"
        )
    return int(train_layers)


# ----------------------------------------------------------------------------------------------- the layers' maths


def layer_attention_mask(backbone: Any, hidden_states: Tensor, attention_mask: Tensor) -> Any:
    """The attention mask ``backbone`` (a ``BertModel`` encoder, never a decoder: :func:`check_partial_transformer`)
    hands its layers for a padded batch: transformers' ``create_bidirectional_mask`` for the configured attention
    implementation (a boolean or additive 4-D mask, or ``None`` for sdpa without padding), which is what
    ``BertModel._create_attention_masks`` builds for an encoder; called directly because that private method's
    signature differs between transformers 5 releases. ``hidden_states`` (B, T, H) gives the dtype, device and
    length, ``attention_mask`` is the 2-D (B, T) padding mask."""
    from transformers.masking_utils import create_bidirectional_mask

    return create_bidirectional_mask(config=backbone.config, inputs_embeds=hidden_states, attention_mask=attention_mask)


def run_top_layers(
    backbone: Any, hidden_states: Tensor, attention_mask: Tensor, start: int, stop: int | None = None
) -> Tensor:
    """``backbone``'s layers ``start..stop-1`` (default: to the last) on ``hidden_states`` (the states entering layer
    ``start``), as ``BertEncoder.forward`` runs them for an encoder (no cross-attention, no cache): the output of
    layer ``stop - 1``, (B, T, H). Layers that return a tuple (older transformers 5 releases) give their first
    element."""
    mask = layer_attention_mask(backbone, hidden_states, attention_mask)
    for layer in backbone.encoder.layer[start:stop]:
        out = layer(hidden_states, attention_mask=mask)
        hidden_states = out[0] if isinstance(out, tuple) else out
    return hidden_states


class _Stop(Exception):
    pass


@contextlib.contextmanager
def _states_entering(backbone: Any, layer: int) -> Iterator[list[Tensor]]:
    """Within the block, a forward of ``backbone`` stops (raises :class:`_Stop`) on reaching layer ``layer``,
    leaving the hidden states that enter it in the yielded list."""
    captured: list[Tensor] = []

    def hook(module: Any, args: tuple) -> None:
        captured.append(args[0])
        raise _Stop

    handle = backbone.encoder.layer[layer].register_forward_pre_hook(hook)
    try:
        yield captured
    finally:
        handle.remove()


# ------------------------------------------------------------------------------------------------------ fingerprint


_CONFIG_KEYS = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "num_attention_heads",
    "intermediate_size",
    "hidden_act",
    "layer_norm_eps",
    "max_position_embeddings",
    "type_vocab_size",
    "position_embedding_type",
    "pad_token_id",
)


def _tokenizer_description(tokenizer: Any) -> Any:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        spec = json.loads(backend.to_str())
        spec.pop("truncation", None)  # call-time state, set by every tokenizer call
        spec.pop("padding", None)
        return spec
    return {"class": type(tokenizer).__name__, "vocab": sorted(tokenizer.get_vocab().items())}


def state_fingerprint(transformer: Transformer, frozen_layers: int) -> str:
    """A hash of everything the hidden states entering layer ``frozen_layers`` depend on: the tokenizer, the
    ``Transformer``'s settings, the backbone's architecture and the weights of its embeddings and lower
    ``frozen_layers`` layers (not its path: a copy, or a model whose top layers were trained, has the same)."""
    backbone = check_partial_transformer(transformer)
    config = backbone.config
    h = hashlib.sha256()
    described = {
        "backbone": type(backbone).__name__,
        "config": {k: getattr(config, k, None) for k in _CONFIG_KEYS},
        "transformer": transformer.get_config_dict(),
        "tokenizer": _tokenizer_description(transformer.tokenizer),
        "frozen_layers": frozen_layers,
    }
    h.update(json.dumps(described, sort_keys=True, default=str).encode())
    named = [(f"embeddings.{n}", t) for n, t in backbone.embeddings.state_dict().items()]
    for i in range(frozen_layers):
        named += [(f"layer.{i}.{n}", t) for n, t in backbone.encoder.layer[i].state_dict().items()]
    for name, t in named:
        t = t.detach().to("cpu").contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def _weights_token(transformer: Transformer, frozen_layers: int) -> tuple:
    """A cheap token that changes when a frozen weight is replaced or modified in place (storage and version
    counter of each tensor): the full :func:`state_fingerprint` is recomputed only when it changes."""
    backbone = transformer.auto_model
    tensors = list(backbone.embeddings.state_dict().values())
    for i in range(frozen_layers):
        tensors += list(backbone.encoder.layer[i].state_dict().values())
    return tuple((t.data_ptr(), t._version, t.dtype, str(t.device)) for t in tensors)


# ------------------------------------------------------------------------------------------------------ the cache


@contextlib.contextmanager
def _locked(folder: str) -> Iterator[None]:
    """An exclusive lock on ``folder`` (flock on its lock file; a no-op where flock is missing)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not posix
        yield
        return
    with open(os.path.join(folder, LOCK), "a+b") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _encode_key(key: Key) -> bytes:
    return (key if isinstance(key, str) else json.dumps(list(key), ensure_ascii=False)).encode("utf8")


def _decode_key(raw: bytes, pairs: bool) -> Key:
    text = raw.decode("utf8")
    return tuple(json.loads(text)) if pairs else text


def _as_key(x: Any, pairs: bool) -> Key:
    if pairs:
        if isinstance(x, str) or not isinstance(x, (tuple, list)) or len(x) != 2:
            raise ValueError(f"a cross-encoder input is a (query, document) pair, got {x!r:.80}")
        if not all(isinstance(t, str) for t in x):
            raise ValueError(f"a (query, document) pair holds two strings, got {x!r:.80}")
        return (x[0], x[1])
    if not isinstance(x, str):
        raise ValueError(f"the partial-training cache holds texts (str), got {type(x).__name__}: {x!r:.80}")
    return x


class LayerStateCache:
    """The hidden states entering layer ``frozen_layers`` of a BERT ``Transformer``, per distinct text (or
    (query, document) pair), in a folder on disk, reused across runs.

    What is cached, per key (a text, or a pair tokenised together as a cross-encoder does): the token ids the
    ``Transformer`` gives it (truncated at its ``max_seq_length``; padding dropped) and the hidden states that enter
    layer ``frozen_layers`` (the output of the embeddings and of layers ``0..frozen_layers-1``, computed in eval mode,
    so without dropout), one row of ``hidden_size`` values per token. Files in the folder:

    - ``meta.json``: format, the model's name or path, the :func:`state_fingerprint` (tokenizer, settings and the
      frozen weights), ``max_seq_length``, ``num_layers`` (L), ``frozen_layers`` (L - N), ``train_layers`` (N),
      ``hidden_size``, ``dtype`` and the key kind (``"text"`` or ``"pair"``);
    - ``states.bin``: every key's states, one after the other, ``(total tokens, hidden_size)`` of ``dtype``
      (fp16 by default), read through ``np.memmap``;
    - ``tokens.bin``: the token ids, int32, one per row of ``states.bin``;
    - ``keys.bin``: the keys, UTF-8 (a pair as a JSON list), one after the other;
    - ``rows.bin``: per key, int64, where its key ends in ``keys.bin`` and where its tokens end in ``states.bin``;
    - ``index.json``: how many keys, tokens and key bytes are committed (the commit point).

    Disk size: at most ``n_keys * max_seq_length * hidden_size * 2`` bytes of states in fp16 (4 in fp32), plus 4
    bytes of token id per token, 16 bytes per key and the keys' text; e.g. 100k documents of 128 tokens at hidden
    size 384 take 9.8 GB. Memory holds a dict key -> row and the row offsets; states are read per batch.

    Writes are atomic: ``meta.json`` and ``index.json`` are written to a temporary file and renamed over the old
    one (``os.replace``); the data files are append-only: new keys are appended (and fsynced) before the new
    ``index.json``, which alone says how much of each file is valid, replaces the old one, so a reader (or a crashed
    writer) never sees a half-written key, and a commit costs the new keys only. What a crashed writer left beyond
    the committed counts is dropped by the next one. Writers take a lock on the folder; a cache sees what another
    committed when it opens or extends. Don't rebuild (``overwrite``) a folder another process is using.

    Args:
        folder: the cache folder (created if missing). ``None``: a temporary folder removed with this object.
        transformer: the ``Transformer`` whose lower layers compute missing states (the *encoder*); ``None`` opens
            an existing cache read-only (a key it lacks raises ``KeyError``).
        frozen_layers: L - N, the layer whose input is cached (with ``transformer``: required).
        pairs: keys are (query, document) pairs (a cross-encoder) rather than texts.
        dtype: ``"float16"`` (default) or ``"float32"`` storage.
        overwrite: a folder holding a cache of other settings (another model, ``max_seq_length``, layer, dtype or key
            kind) is emptied and rebuilt; by default that is a ``ValueError``.
        batch_size: keys per forward pass when computing states.
        show_progress_bar: show a bar while computing states.
    """

    def __init__(
        self,
        folder: str | os.PathLike | None,
        transformer: Transformer | None = None,
        frozen_layers: int | None = None,
        *,
        pairs: bool = False,
        dtype: str = "float16",
        overwrite: bool = False,
        batch_size: int = 32,
        show_progress_bar: bool = False,
    ) -> None:
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.batch_size = batch_size
        self.show_progress_bar = show_progress_bar
        #: while computing, the index is committed about this often (so an interrupted run keeps most of its work)
        self.commit_seconds = 60.0
        #: keys whose states this object computed (a reused cache computes none of the keys it had)
        self.computed = 0
        if folder is None:
            if transformer is None:
                raise ValueError("a read-only LayerStateCache (no transformer) needs the folder of an existing cache")
            folder = tempfile.mkdtemp(prefix="layer-states-")
            self._cleanup = weakref.finalize(self, shutil.rmtree, folder, True)
        self.folder = os.fspath(folder)
        if transformer is None:
            if frozen_layers is not None:
                raise ValueError("frozen_layers is read from the folder when no transformer is given")
            self.meta = self._read_meta()
            if self.meta is None:
                raise ValueError(f"{self.folder!r} holds no layer-state cache (no {META})")
        else:
            backbone = check_partial_transformer(transformer)
            num_layers = _num_layers(backbone)
            if frozen_layers is None or not 0 <= int(frozen_layers) < num_layers:
                raise ValueError(f"frozen_layers must be in 0..{num_layers - 1} (L={num_layers}), got {frozen_layers}")
            frozen_layers = int(frozen_layers)
            wanted = {
                "format": FORMAT,
                "version": VERSION,
                "model": str(getattr(backbone.config, "_name_or_path", "") or ""),
                "fingerprint": state_fingerprint(transformer, frozen_layers),
                "max_seq_length": transformer.max_seq_length,
                "num_layers": num_layers,
                "frozen_layers": frozen_layers,
                "train_layers": num_layers - frozen_layers,
                "hidden_size": int(backbone.config.hidden_size),
                "dtype": dtype,
                "keys": "pair" if pairs else "text",
            }
            os.makedirs(self.folder, exist_ok=True)
            with _locked(self.folder):
                found = self._read_meta()
                differ = self._differences(found, wanted) if found is not None else {}
                if differ and not overwrite:
                    raise ValueError(
                        f"the layer-state cache in {self.folder!r} was built with other settings (found, wanted): "
                        f"{differ}; pass overwrite=True to rebuild it, or use another folder"
                    )
                if found is None or differ:
                    self._create(wanted)
                self.meta = self._read_meta()
        self.encoder = transformer
        # (encoder id, weights token) last checked against the fingerprint: a cheap re-check before computing
        self._checked = (
            (id(transformer), _weights_token(transformer, self.frozen_layers)) if transformer is not None else None
        )
        self.pairs = self.meta["keys"] == "pair"
        self._np_dtype = np.dtype(self.meta["dtype"])
        self._reset()
        self._load_index()

    # ---- meta / files

    @staticmethod
    def _differences(found: dict, wanted: dict) -> dict[str, tuple]:
        keys = ("format", "version", "fingerprint", "max_seq_length", "frozen_layers", "hidden_size", "dtype", "keys")
        return {k: (found.get(k), wanted[k]) for k in keys if found.get(k) != wanted[k]}

    def _read_meta(self) -> dict | None:
        path = os.path.join(self.folder, META)
        if not os.path.isfile(path):
            return None
        with open(path, encoding="utf8") as f:
            meta = json.load(f)
        if meta.get("format") != FORMAT:
            raise ValueError(f"{path!r} is not a layer-state cache (format {meta.get('format')!r})")
        return meta

    def _create(self, meta: dict) -> None:
        for name in (META, INDEX, *DATA_FILES):  # meta first: a folder without it holds no cache
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(self.folder, name))
        for name in DATA_FILES:
            atomic_write(os.path.join(self.folder, name), lambda f: None)
        self._write_index(0, 0, 0)
        atomic_write(os.path.join(self.folder, META), lambda f: f.write(json.dumps(meta, indent=1).encode()))

    def _write_index(self, keys: int, tokens: int, key_bytes: int) -> None:
        counts = {"keys": keys, "tokens": tokens, "key_bytes": key_bytes}
        atomic_write(os.path.join(self.folder, INDEX), lambda f: f.write(json.dumps(counts).encode()))

    def _read_index(self) -> tuple[int, int, int]:
        with open(os.path.join(self.folder, INDEX), encoding="utf8") as f:
            counts = json.load(f)
        return int(counts["keys"]), int(counts["tokens"]), int(counts["key_bytes"])

    def _reset(self) -> None:
        self._rows: dict[Key, int] = {}
        self._offsets = np.zeros(1, np.int64)  # token offsets of the rows, n_keys + 1
        self._key_bytes = 0
        self._states: np.memmap | None = None
        self._ids: np.memmap | None = None

    def _load_index(self) -> None:
        """Catch up with what is committed on disk (only the keys added since the last look are read)."""
        meta = self._read_meta()
        if meta != self.meta:
            raise ValueError(f"the layer-state cache in {self.folder!r} was rebuilt with other settings meanwhile")
        n_keys, n_tokens, n_key_bytes = self._read_index()
        if n_keys < len(self._rows):
            self._reset()
        hidden, item = self.hidden_size, self._np_dtype.itemsize
        sizes = {
            STATES: n_tokens * hidden * item,
            TOKENS: n_tokens * 4,
            KEYS: n_key_bytes,
            ROWS: n_keys * 16,
        }
        for name, needed in sizes.items():
            have = os.path.getsize(os.path.join(self.folder, name))
            if have < needed:
                raise ValueError(f"{name} in {self.folder!r} is shorter than its index says ({have} < {needed} bytes)")
        old = len(self._rows)
        if n_keys > old:
            ends = np.fromfile(
                os.path.join(self.folder, ROWS), dtype=np.int64, count=2 * (n_keys - old), offset=old * 16
            )
            ends = ends.reshape(-1, 2)
            with open(os.path.join(self.folder, KEYS), "rb") as f:
                f.seek(self._key_bytes)
                raw = f.read(n_key_bytes - self._key_bytes)
            starts = np.concatenate([[self._key_bytes], ends[:-1, 0]]) - self._key_bytes
            for i, (a, b) in enumerate(zip(starts, ends[:, 0] - self._key_bytes)):
                self._rows[_decode_key(raw[a:b], self.pairs)] = old + i
            self._offsets = np.concatenate([self._offsets, ends[:, 1]])
            self._key_bytes = n_key_bytes
        if int(self._offsets[-1]) != n_tokens:
            raise ValueError(f"the index of the layer-state cache in {self.folder!r} is inconsistent")
        if n_tokens and (self._states is None or len(self._states) != n_tokens):
            self._states = np.memmap(
                os.path.join(self.folder, STATES), dtype=self._np_dtype, mode="r", shape=(n_tokens, hidden)
            )
            self._ids = np.memmap(os.path.join(self.folder, TOKENS), dtype=np.int32, mode="r", shape=(n_tokens,))

    # ---- properties

    @property
    def frozen_layers(self) -> int:
        """L - N: the layer whose input states are cached."""
        return int(self.meta["frozen_layers"])

    @property
    def max_seq_length(self) -> int | None:
        return self.meta["max_seq_length"]

    @property
    def hidden_size(self) -> int:
        return int(self.meta["hidden_size"])

    @property
    def fingerprint(self) -> str:
        return self.meta["fingerprint"]

    def __len__(self) -> int:
        return len(self._rows)

    def __contains__(self, key: Any) -> bool:
        return _as_key(key, self.pairs) in self._rows

    def nbytes(self) -> int:
        """Bytes of cached states (``states.bin``)."""
        return 0 if self._states is None else int(self._states.nbytes)

    def __repr__(self) -> str:
        kind = "pairs" if self.pairs else "texts"
        return (
            f"LayerStateCache({len(self)} {kind}, states entering layer {self.frozen_layers} of "
            f"{self.meta['num_layers']}, {self.meta['dtype']}, {self.nbytes() / 2**20:.1f} MiB in {self.folder!r})"
        )

    # ---- look-up and extension

    def missing(self, keys: Iterable[Any]) -> list[Key]:
        """The distinct keys of ``keys`` not cached yet, in first-seen order."""
        return [k for k in dict.fromkeys(_as_key(x, self.pairs) for x in keys) if k not in self._rows]

    def extend(self, keys: Iterable[Any]) -> int:
        """Compute and store the states of the keys not cached yet (with the encoder, in eval mode); returns how many
        were added. Without an encoder, a missing key raises ``KeyError`` naming it."""
        new = self.missing(keys)
        if not new:
            return 0
        if self.encoder is None:
            raise KeyError(f"not in the layer-state cache and no encoder to compute it: {new[0]!r:.100}")
        if self._checked != (id(self.encoder), _weights_token(self.encoder, self.frozen_layers)):
            fingerprint = state_fingerprint(self.encoder, self.frozen_layers)
            self._checked = (id(self.encoder), _weights_token(self.encoder, self.frozen_layers))
        else:
            fingerprint = self.fingerprint
        if fingerprint != self.fingerprint or self.encoder.max_seq_length != self.max_seq_length:
            raise ValueError(
                "the encoder no longer matches the layer-state cache (its frozen weights, tokenizer or "
                "max_seq_length changed since the cache was opened)"
            )
        with _locked(self.folder):
            self._load_index()  # another writer may have committed meanwhile
            new = [k for k in new if k not in self._rows]
            if not new:
                return 0
            self._append(new)
        return len(new)

    def rows(self, keys: Sequence[Any]) -> list[int]:
        """The row of each key, computing the missing ones first (with the encoder; without: ``KeyError``)."""
        keys = [_as_key(x, self.pairs) for x in keys]
        if self.encoder is not None:
            self.extend(keys)
        out = []
        for k in keys:
            row = self._rows.get(k)
            if row is None:
                raise KeyError(
                    "not in the layer-state cache (was it in the training data?) and no encoder to compute it: "
                    f"{k!r:.100}"
                )
            out.append(row)
        return out

    def token_ids(self, row: int) -> np.ndarray:
        """The cached token ids of key ``row`` (no padding)."""
        if self._ids is None:
            raise IndexError(f"row {row} of an empty cache")
        return self._ids[self._offsets[row] : self._offsets[row + 1]]

    def states(self, row: int) -> np.ndarray:
        """The cached states of key ``row``, ``(n_tokens, hidden_size)`` of the storage dtype (a memmap view)."""
        if self._states is None:
            raise IndexError(f"row {row} of an empty cache")
        return self._states[self._offsets[row] : self._offsets[row + 1]]

    def lengths(self, rows: Sequence[int]) -> np.ndarray:
        rows = np.asarray(rows, dtype=np.int64)
        return self._offsets[rows + 1] - self._offsets[rows]

    def gather(self, rows: Sequence[int], length: int | None = None) -> np.ndarray:
        """The states of ``rows`` right-padded with zeros to ``length`` (default: the longest): ``(B, T, H)``."""
        lengths = self.lengths(rows)
        length = int(lengths.max(initial=0)) if length is None else int(length)
        if len(lengths) and lengths.max() > length:
            raise ValueError(f"a row has {lengths.max()} tokens, more than the batch length {length}")
        out = np.zeros((len(lengths), length, self.hidden_size), dtype=self._np_dtype)
        for i, row in enumerate(rows):
            out[i, : lengths[i]] = self.states(int(row))
        return out

    # ---- computing

    def _compute(self, keys: Sequence[Key]) -> Iterator[tuple[list[int], list[np.ndarray], list[np.ndarray]]]:
        """Per batch (longest keys first): (positions in ``keys``, token ids, states) of its keys."""
        from tqdm.autonotebook import tqdm

        transformer = self.encoder
        backbone = transformer.auto_model
        device = next(backbone.parameters()).device
        order = np.argsort([-BaseModel._input_length(k) for k in keys], kind="stable")
        was_training = transformer.training
        transformer.eval()
        try:
            with tqdm(total=len(keys), desc="layer states", disable=not self.show_progress_bar) as bar:
                for start in range(0, len(keys), self.batch_size):
                    idx = [int(i) for i in order[start : start + self.batch_size]]
                    features = transformer.preprocess([keys[i] for i in idx])
                    if "attention_mask" not in features or "input_ids" not in features:
                        raise ValueError("the Transformer's preprocess gave no input_ids / attention_mask")
                    mask = features["attention_mask"].bool()
                    ids = features["input_ids"]
                    features = {k: v.to(device) if isinstance(v, Tensor) else v for k, v in features.items()}
                    with torch.inference_mode(), _states_entering(backbone, self.frozen_layers) as captured:
                        with contextlib.suppress(_Stop):
                            transformer(features)
                    if not captured:
                        raise RuntimeError(f"layer {self.frozen_layers} of the backbone was never reached")
                    hidden = captured[0].float().cpu()
                    yield (
                        idx,
                        [ids[j][mask[j]].numpy().astype(np.int32) for j in range(len(idx))],
                        [hidden[j][mask[j]].numpy().astype(self._np_dtype) for j in range(len(idx))],
                    )
                    bar.update(len(idx))
        finally:
            transformer.train(was_training)

    def _append(self, keys: list[Key]) -> None:
        """Append ``keys``' states (in the order computed: longest first) and commit them, at the end and about
        every ``commit_seconds`` of computing (the caller holds the lock and has caught up with the index)."""
        n_tokens = int(self._offsets[-1])
        committed = {
            STATES: n_tokens * self.hidden_size * self._np_dtype.itemsize,
            TOKENS: n_tokens * 4,
            KEYS: self._key_bytes,
            ROWS: len(self._rows) * 16,
        }
        with contextlib.ExitStack() as stack:
            files = {name: stack.enter_context(open(os.path.join(self.folder, name), "r+b")) for name in DATA_FILES}
            for name, f in files.items():
                f.truncate(committed[name])  # drop what a crashed writer left beyond the committed index
                f.seek(committed[name])
            counts = [len(self._rows), n_tokens, self._key_bytes]
            pending, last = 0, time.monotonic()
            for positions, tok, states in self._compute(keys):
                for p, t, s in zip(positions, tok, states):
                    raw = _encode_key(keys[p])
                    files[STATES].write(np.ascontiguousarray(s).tobytes())
                    files[TOKENS].write(np.ascontiguousarray(t, dtype=np.int32).tobytes())
                    files[KEYS].write(raw)
                    counts = [counts[0] + 1, counts[1] + len(t), counts[2] + len(raw)]
                    files[ROWS].write(np.array([counts[2], counts[1]], dtype=np.int64).tobytes())
                    pending += 1
                if time.monotonic() - last > self.commit_seconds:
                    self._commit(files, counts)
                    pending, last = 0, time.monotonic()
            if pending:
                self._commit(files, counts)
        self.computed += len(keys)

    def _commit(self, files: dict[str, Any], counts: list[int]) -> None:
        """Make the appended data durable, then write the new counts (atomically) and catch up with them."""
        for f in files.values():
            f.flush()
            os.fsync(f.fileno())
        self._write_index(*counts)
        self._load_index()


# ------------------------------------------------------------------------------------------------ the input module


class PartialTransformer(InputModule):
    """Input module standing in for a BERT ``Transformer`` during partial training: the lower layers' states come
    from a :class:`LayerStateCache`, the top layers are the ``Transformer``'s own (shared, not copied).

    ``preprocess(texts)`` (pairs for a cross-encoder) maps each key to its cache row, computing the states of keys
    not cached yet when the cache holds its encoder (else ``KeyError`` naming the key), and gives ``input_ids`` (the
    cached token ids, right-padded), ``attention_mask`` and the rows. ``forward`` rebuilds the padded batch of cached
    states (cast to the backbone's dtype, float32 normally), builds the layers' attention mask as ``BertModel`` does
    (:func:`layer_attention_mask`), runs layers ``frozen_layers..L-1`` of the ``Transformer``'s backbone and writes
    ``features["token_embeddings"]`` (at padded positions: the top layers' outputs of zero states, which pooling
    masks out). Prompts, per-call ``processing_kwargs`` and a ``max_length`` other than the cache's are refused:
    the cached states are those of the texts as tokenised when cached. A training-time stand-in: it cannot be saved
    (save the model it was made from).

    Args:
        transformer: the model's ``Transformer`` (its backbone's top layers run here and train in place).
        cache: the lower layers' states; made with this ``transformer`` (same :func:`state_fingerprint`).
    """

    save_in_root = False

    def __init__(self, transformer: Transformer, cache: LayerStateCache) -> None:
        super().__init__()
        backbone = check_partial_transformer(transformer)
        if cache.max_seq_length != transformer.max_seq_length:
            raise ValueError(
                f"the cache holds states of texts cut at max_seq_length={cache.max_seq_length}, the Transformer cuts "
                f"at {transformer.max_seq_length}"
            )
        if cache.hidden_size != backbone.config.hidden_size or cache.meta["num_layers"] != _num_layers(backbone):
            raise ValueError("the cache was made with another backbone (hidden size or layer count differ)")
        self.transformer = transformer
        self.cache = cache

    @property
    def modalities(self) -> list[str]:
        return ["text"]

    @property
    def frozen_layers(self) -> int:
        return self.cache.frozen_layers

    @property
    def train_layers(self) -> int:
        return _num_layers(self.transformer.auto_model) - self.frozen_layers

    @property
    def tokenizer(self) -> Any:
        return self.transformer.tokenizer

    @property
    def max_seq_length(self) -> int | None:
        return self.cache.max_seq_length

    @max_seq_length.setter
    def max_seq_length(self, value: int | None) -> None:
        if value != self.cache.max_seq_length:
            raise ValueError(f"the layer-state cache holds texts cut at max_seq_length={self.cache.max_seq_length}")

    def get_embedding_dimension(self) -> int:
        return self.transformer.get_embedding_dimension()

    def preprocess(self, inputs: Sequence[Any], prompt: str | None = None, **kwargs: Any) -> dict[str, Any]:
        if prompt:
            raise ValueError("PartialTransformer caches states of texts without prompts; got a prompt")
        if kwargs.get("processing_kwargs"):
            raise ValueError("PartialTransformer caches one tokenisation per text: processing_kwargs are refused")
        max_length = kwargs.get("max_length")
        if max_length is not None and max_length != self.cache.max_seq_length:
            raise ValueError(
                f"the layer-state cache holds texts cut at {self.cache.max_seq_length} tokens, "
                f"got max_length={max_length}"
            )
        inputs = list(inputs)
        if not inputs:
            return {}
        if self.cache.pairs and all(isinstance(t, str) for t in inputs):
            return {"unpaired_texts": inputs}  # e.g. the model card measuring one column: nothing to score
        rows = self.cache.rows(inputs)
        lengths = self.cache.lengths(rows)
        length = int(lengths.max())
        pad = self.tokenizer.pad_token_id or 0
        input_ids = torch.full((len(rows), length), pad, dtype=torch.long)
        attention_mask = torch.zeros((len(rows), length), dtype=torch.long)
        for i, row in enumerate(rows):
            input_ids[i, : lengths[i]] = torch.from_numpy(self.cache.token_ids(row).astype(np.int64))
            attention_mask[i, : lengths[i]] = 1
        return {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "cache_rows": torch.tensor(rows, dtype=torch.long),
            "modality": "text",
        }

    def forward(self, features: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
        if "unpaired_texts" in features:
            raise ValueError("a cross-encoder scores (query, document) pairs, got single texts")
        backbone = self.transformer.auto_model
        mask = features["attention_mask"]
        rows = features["cache_rows"].tolist()
        states = self.cache.gather(rows, mask.shape[1])
        weight = backbone.encoder.layer[self.frozen_layers].attention.self.query.weight
        hidden = torch.from_numpy(states).to(device=weight.device, dtype=weight.dtype)
        features[self.transformer.module_output_name] = run_top_layers(
            backbone, hidden, mask.to(weight.device), self.frozen_layers
        )
        return features

    def save(self, output_path: str, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError("PartialTransformer is a training-time stand-in: save the full model instead")

    def __repr__(self) -> str:
        return f"PartialTransformer(top {self.train_layers} layers, {self.cache!r})"


# ------------------------------------------------------------------------------------------------------- the model


def partial_model(
    model: SentenceTransformer | CrossEncoder,
    train_layers: int,
    texts: Iterable[Any] = (),
    cache: LayerStateCache | None = None,
    cache_dir: str | os.PathLike | None = None,
    *,
    batch_size: int = 32,
    show_progress_bar: bool = False,
    dtype: str = "float16",
    overwrite: bool = False,
    encode_missing: bool = True,
) -> SentenceTransformer | CrossEncoder:
    """The partial-training stand-in of ``model``: [:class:`PartialTransformer`, ``model``'s other modules...], all
    shared with ``model`` (training it trains ``model`` in place).

    Freezes ``model``'s backbone embeddings and lower ``L - train_layers`` layers (``requires_grad=False``, left so
    afterwards); the top ``train_layers`` layers, the pooling and the added modules keep their ``requires_grad``.
    After training, ``model`` is an ordinary sentence-transformers model: ``model.save(path)`` then
    ``SentenceTransformer(path)`` / ``st_extensions.loading.load_model(path)`` need no cache.

    Args:
        model: a SentenceTransformer ([Transformer, Pooling, ..., added modules]) or a CrossEncoder with a separate
            head ([Transformer, Pooling, head], e.g. a VarCrossEncoder); its Transformer's backbone a ``BertModel``
            (:func:`check_partial_transformer`).
        train_layers: N, the number of top layers that train, 1..L.
        texts: every text (for a CrossEncoder: every (query, document) pair) the training will feed; their states
            are computed now (the others on first use, unless ``encode_missing`` is false). Duplicates are fine.
        cache: a :class:`LayerStateCache` to use (built for this model's frozen part: same fingerprint,
            ``max_seq_length`` and layer; else ``ValueError``); extended with the texts it lacks.
        cache_dir: the cache folder (reused when it holds a cache of the same settings, extended with the texts it
            lacks); ``None`` (and no ``cache``): a temporary folder removed with the stand-in's cache.
        batch_size: texts per forward pass when computing states.
        show_progress_bar: show the bar while computing states.
        dtype: storage of a new cache, ``"float16"`` or ``"float32"``.
        overwrite: rebuild a ``cache_dir`` that holds a cache of other settings (default: ``ValueError``).
        encode_missing: texts not in the cache are computed on first use (the cache holds ``model``'s
            Transformer); ``False``: they raise ``KeyError`` (the cache is then read-only for the stand-in).

    Returns:
        A model of ``model``'s class (a CrossEncoder keeps its ``activation_fn``) whose ``encode`` / ``predict``
        give ``model``'s outputs up to the storage rounding, and which the usual trainers and losses train.

    Raises:
        ValueError: ``train_layers`` not in 1..L; a model the recipe cannot split (see
            :func:`check_partial_transformer`; a CrossEncoder without a head after its Transformer); a cache of
            other settings.
    """
    modules = list(model)
    if not modules:
        raise ValueError("partial training needs a model with modules")
    transformer = modules[0]
    backbone = check_partial_transformer(transformer)
    num_layers = _num_layers(backbone)
    n = _check_train_layers(train_layers, num_layers)
    frozen = num_layers - n
    pairs = isinstance(model, CrossEncoder)
    if pairs and len(modules) < 2:
        raise ValueError("partial training of a CrossEncoder needs a head after its Transformer (Pooling + head)")
    if not pairs and not isinstance(model, SentenceTransformer):
        raise ValueError(
            f"partial training handles SentenceTransformer and CrossEncoder models, got {type(model).__name__}"
        )
    if cache is not None:
        if cache_dir is not None and os.path.abspath(os.fspath(cache_dir)) != os.path.abspath(cache.folder):
            raise ValueError(f"cache (in {cache.folder!r}) and cache_dir={os.fspath(cache_dir)!r} disagree: pass one")
        problems = []
        if cache.pairs != pairs:
            problems.append(f"keys are {'pairs' if cache.pairs else 'texts'}, the model needs the other")
        if cache.frozen_layers != frozen:
            problems.append(f"it caches the input of layer {cache.frozen_layers}, train_layers={n} needs {frozen}")
        if cache.max_seq_length != transformer.max_seq_length:
            problems.append(f"max_seq_length {cache.max_seq_length} != the model's {transformer.max_seq_length}")
        if not problems and cache.fingerprint != state_fingerprint(transformer, frozen):
            problems.append("it was computed with other frozen weights or another tokenizer")
        if problems:
            raise ValueError("the layer-state cache does not fit this model: " + "; ".join(problems))
        cache._checked = (id(transformer), _weights_token(transformer, frozen))
        if encode_missing and cache.encoder is None:
            cache.encoder = transformer
        elif not encode_missing:
            cache.encoder = None
    else:
        cache = LayerStateCache(
            cache_dir,
            transformer,
            frozen,
            pairs=pairs,
            dtype=dtype,
            overwrite=overwrite,
            batch_size=batch_size,
            show_progress_bar=show_progress_bar,
        )
    cache.batch_size, cache.show_progress_bar = batch_size, show_progress_bar
    if cache.encoder is None:
        cache.encoder = transformer  # compute the given texts now
        try:
            cache.extend(texts)
        finally:
            cache.encoder = None
    else:
        cache.extend(texts)
        if not encode_missing:
            cache.encoder = None
    for p in backbone.embeddings.parameters():
        p.requires_grad_(False)
    for layer in backbone.encoder.layer[:frozen]:
        for p in layer.parameters():
            p.requires_grad_(False)
    stand_in_modules = [PartialTransformer(transformer, cache), *modules[1:]]
    if pairs:
        return type(model)(modules=stand_in_modules, device=str(model.device), activation_fn=model.activation_fn)
    return SentenceTransformer(modules=stand_in_modules, device=str(model.device))


# ------------------------------------------------------------------------------------- scoring with shared layers


def predict_sharing_layers(
    models: Sequence[CrossEncoder],
    pairs: Sequence[Any],
    frozen_layers: int,
    *,
    batch_size: int = 32,
    show_progress_bar: bool = False,
) -> list[tuple[np.ndarray, np.ndarray | None]]:
    """Score ``pairs`` with several cross-encoders that share their embeddings and lower ``frozen_layers`` layers
    (e.g. a CrossEncoder and VarCrossEncoders fine-tuned from one backbone under the partial recipe): each batch runs
    the shared lower layers once and every model's own top layers and head on their output. The result is each
    model's ``predict`` (its logits ``scores``, no activation) computed in fp32, up to float rounding; for a model
    whose head writes a score variance (a VarCrossEncoder, Eq. 23) its standard deviation too.

    Args:
        models: cross-encoders whose first module is a BERT ``Transformer`` (:func:`check_partial_transformer`)
            with the same :func:`state_fingerprint` at ``frozen_layers`` (same tokenizer, settings and lower
            weights), each followed by its pooling and head.
        pairs: (query, document) pairs.
        frozen_layers: how many lower layers the models share (L - the partial recipe's ``train_layers``).
        batch_size: pairs per forward pass.
        show_progress_bar: a bar over the pairs.

    Returns:
        Per model, ``(scores, stds)``: float32 arrays in the order of ``pairs``; ``stds`` None for a model without a
        score variance.

    Raises:
        ValueError: no model, a model that cannot be split, or models whose lower layers differ.
    """
    from tqdm.autonotebook import tqdm

    from st_extensions.cross_encoder.head import SCORE_VAR_KEY

    models = list(models)
    if not models:
        raise ValueError("predict_sharing_layers needs at least one model")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    transformers = [list(m)[0] for m in models]
    for t in transformers:
        check_partial_transformer(t)
    num_layers = _num_layers(transformers[0].auto_model)
    if isinstance(frozen_layers, bool) or not isinstance(frozen_layers, (int, np.integer)):
        raise ValueError(f"frozen_layers must be an int in 0..{num_layers - 1}, got {frozen_layers!r}")
    frozen = int(frozen_layers)
    if not 0 <= frozen < num_layers:
        raise ValueError(f"frozen_layers must be in 0..{num_layers - 1} (the models have {num_layers} layers)")
    prints = [state_fingerprint(t, frozen) for t in transformers]
    differ = [i for i, p in enumerate(prints) if p != prints[0]]
    if differ:
        raise ValueError(
            f"models {differ} do not share the embeddings, lower {frozen} layers, tokenizer or settings of model 0: "
            "score them separately"
        )
    keys = [_as_key(p, True) for p in pairs]
    n = len(keys)
    scores = [np.empty(n, np.float32) for _ in models]
    variances: list[np.ndarray | None] = [None] * len(models)
    first, backbone0 = transformers[0], transformers[0].auto_model
    device = next(backbone0.parameters()).device
    order = np.argsort([-BaseModel._input_length(k) for k in keys], kind="stable")
    states = [m.training for m in models]
    for m in models:
        m.eval()
    try:
        with torch.inference_mode(), tqdm(total=n, desc="scoring", disable=not show_progress_bar) as bar:
            for start in range(0, n, batch_size):
                idx = order[start : start + batch_size]
                features = first.preprocess([keys[i] for i in idx])
                features = {k: v.to(device) if isinstance(v, Tensor) else v for k, v in features.items()}
                mask = features["attention_mask"]
                with _states_entering(backbone0, frozen) as captured, contextlib.suppress(_Stop):
                    first(dict(features))
                hidden = captured[0]
                for j, (model, t) in enumerate(zip(models, transformers)):
                    out = dict(features)
                    out[t.module_output_name] = run_top_layers(t.auto_model, hidden, mask, frozen)
                    for module in list(model)[1:]:
                        out = module(out)
                    scores[j][idx] = out["scores"].float().reshape(-1).cpu().numpy()
                    if SCORE_VAR_KEY in out:
                        if variances[j] is None:
                            variances[j] = np.empty(n, np.float32)
                        variances[j][idx] = out[SCORE_VAR_KEY].float().reshape(-1).cpu().numpy()
                bar.update(len(idx))
    finally:
        for m, was in zip(models, states):
            m.train(was)
    return [(s, None if v is None else np.sqrt(np.clip(v, 0.0, None))) for s, v in zip(scores, variances)]
