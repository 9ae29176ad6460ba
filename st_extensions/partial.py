"""Partial fine-tuning: the top N transformer layers train on the lower layers' hidden states, computed once per text.

:class:`LayerStateCache` keeps the states entering layer L - N of each distinct text (or pair) on disk (fp16 memmap);
:func:`partial_model`'s :class:`PartialTransformer` runs the top N layers of the very same module on them, so training
trains the real model in place. Cache format and differences from full training: ``docs/recipes.md``.
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
from pathlib import Path
from typing import Any

import numpy as np
import torch
from sentence_transformers import CrossEncoder, SentenceTransformer
from sentence_transformers.base.model import BaseModel
from sentence_transformers.base.modules import InputModule, Transformer
from sentence_transformers.util import batch_to_device
from torch import Tensor
from torch.nn.utils.rnn import pad_sequence
from tqdm.autonotebook import tqdm
from transformers.masking_utils import create_bidirectional_mask
from transformers.models.bert.modeling_bert import BertModel

from st_extensions.atomic import CorruptFileError, atomic_write, locked, read_checked
from st_extensions.checks import choice, is_int, positive_int
from st_extensions.frozen import evaluating

__all__ = [
    "LayerStateCache", "PartialTransformer", "check_layers", "check_partial_transformer", "freeze_lower_layers",
    "layer_attention_mask", "longest_first", "pair_key", "partial_model", "run_top_layers", "state_fingerprint",
    "states_entering",
]  # fmt: skip

FORMAT, VERSION = "st_extensions.partial/layer-states", 1
META, INDEX, LOCK = "meta.json", "index.json", ".lock"
STATES, TOKENS, KEYS, ROWS = DATA_FILES = ("states.bin", "tokens.bin", "keys.bin", "rows.bin")
DTYPES = ("float16", "float32")
#: the meta.json fields a reopened cache must agree on
_COMPARED = ("format", "version", "fingerprint", "max_seq_length", "frozen_layers", "hidden_size", "dtype", "keys")

Key = str | tuple[str, str]


# ---------------------------------------------------------------------------------------------------------- checks


def check_partial_transformer(module: Any) -> Any:
    """The backbone (``BertModel``) of ``module``, checked to be a ``Transformer`` the partial recipe can split.

    ValueError otherwise: not a torch feature-extraction ``Transformer`` writing ``token_embeddings`` from
    ``last_hidden_state``, not BERT, unpadded or left-padded inputs, per-task tokenisation, all hidden states returned.
    """
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


def check_layers(name: str, value: Any, low: int, high: int, num_layers: int) -> int:
    """``value`` as an int in ``low..high`` (layers of an encoder of ``num_layers``), else a ValueError naming it."""
    if not is_int(value) or not low <= int(value) <= high:
        raise ValueError(f"{name} must be an int in {low}..{high} (the model has L={num_layers} layers), got {value!r}")
    return int(value)


def freeze_lower_layers(backbone: Any, frozen: int) -> None:
    """Turn off the gradients of ``backbone``'s embeddings and lower ``frozen`` layers (left so afterwards)."""
    for module in (backbone.embeddings, *backbone.encoder.layer[:frozen]):
        module.requires_grad_(False)


# ----------------------------------------------------------------------------------------------- the layers' maths


def layer_attention_mask(backbone: Any, hidden_states: Tensor, attention_mask: Tensor) -> Any:
    """The mask a ``BertModel`` encoder hands its layers for a padded (B, T) ``attention_mask``
    (``create_bidirectional_mask``, called directly: ``BertModel._create_attention_masks``' signature varies in v5)."""
    return create_bidirectional_mask(config=backbone.config, inputs_embeds=hidden_states, attention_mask=attention_mask)


def run_top_layers(
    backbone: Any, hidden_states: Tensor, attention_mask: Tensor, start: int, stop: int | None = None
) -> Tensor:
    """``backbone``'s layers ``start..stop-1`` on the states entering layer ``start``, as ``BertEncoder.forward`` runs
    them for an encoder: the output of layer ``stop - 1``, (B, T, H) (a tuple output gives its first element)."""
    mask = layer_attention_mask(backbone, hidden_states, attention_mask)
    for layer in backbone.encoder.layer[start:stop]:
        out = layer(hidden_states, attention_mask=mask)
        hidden_states = out[0] if isinstance(out, tuple) else out
    return hidden_states


def longest_first(keys: Sequence[Any], batch_size: int, desc: str, show_progress_bar: bool) -> Iterator[list[int]]:
    """The positions of ``keys`` in batches of ``batch_size``, longest input first (as ``predict`` orders them), with
    a progress bar over the keys."""
    order = np.argsort([-BaseModel._input_length(k) for k in keys], kind="stable")
    with tqdm(total=len(keys), desc=desc, disable=not show_progress_bar) as bar:
        for start in range(0, len(keys), batch_size):
            idx = [int(i) for i in order[start : start + batch_size]]
            yield idx
            bar.update(len(idx))


class _Stop(Exception):
    pass


def states_entering(transformer: Transformer, features: dict[str, Any], layer: int) -> Tensor:
    """The hidden states entering layer ``layer`` of ``transformer``'s backbone for the tokenised ``features``: a
    forward stopped on reaching that layer (a pre-hook raises there)."""
    captured: list[Tensor] = []

    def hook(module: Any, args: tuple) -> None:
        captured.append(args[0])
        raise _Stop

    # first among the layer's pre-hooks: the states before any (a MoL token_layer's), which the top layers apply
    handle = transformer.auto_model.encoder.layer[layer].register_forward_pre_hook(hook, prepend=True)
    try:
        with contextlib.suppress(_Stop):
            transformer(features)
    finally:
        handle.remove()
    if not captured:
        raise RuntimeError(f"layer {layer} of the backbone was never reached")
    return captured[0]


# ------------------------------------------------------------------------------------------------------ fingerprint


_CONFIG_KEYS = (
    "model_type", "vocab_size", "hidden_size", "num_attention_heads", "intermediate_size", "hidden_act",
    "layer_norm_eps", "max_position_embeddings", "type_vocab_size", "position_embedding_type", "pad_token_id",
)  # fmt: skip


def _tokenizer_description(tokenizer: Any) -> Any:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:  # without truncation and padding: call-time state, set by every tokenizer call
        return {k: v for k, v in json.loads(backend.to_str()).items() if k not in ("truncation", "padding")}
    return {"class": type(tokenizer).__name__, "vocab": sorted(tokenizer.get_vocab().items())}


def state_fingerprint(transformer: Transformer, frozen_layers: int) -> str:
    """A hash of everything the hidden states entering layer ``frozen_layers`` depend on: the tokenizer, the
    ``Transformer``'s settings, the backbone's architecture and the weights of its embeddings and lower
    ``frozen_layers`` layers (not its path: a copy, or a model whose top layers were trained, has the same)."""
    backbone = check_partial_transformer(transformer)
    config = backbone.config
    described = {
        "backbone": type(backbone).__name__,
        "config": {k: getattr(config, k, None) for k in _CONFIG_KEYS},
        "transformer": {  # less the settings of the layers above (e.g. a split cross-encoder's joint ones)
            k: v for k, v in transformer.get_config_dict().items() if k not in getattr(transformer, "top_only_keys", ())
        },
        "tokenizer": _tokenizer_description(transformer.tokenizer),
        "frozen_layers": frozen_layers,
    }
    h = hashlib.sha256(json.dumps(described, sort_keys=True, default=str).encode())
    for name, t in _frozen_tensors(backbone, frozen_layers):
        t = t.detach().to("cpu").contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def _weights_token(transformer: Transformer, frozen_layers: int) -> tuple:
    """A cheap token that changes when a frozen weight is replaced or modified in place (storage and version
    counter of each tensor): the full :func:`state_fingerprint` is recomputed only when it changes."""
    tensors = _frozen_tensors(transformer.auto_model, frozen_layers)
    return tuple((t.data_ptr(), t._version, t.dtype, str(t.device)) for _, t in tensors)


def _frozen_tensors(backbone: Any, frozen_layers: int) -> list[tuple[str, Tensor]]:
    """(name, tensor) of the state of ``backbone``'s embeddings and lower ``frozen_layers`` layers."""
    layers = {f"layer.{i}": backbone.encoder.layer[i] for i in range(frozen_layers)}
    parts = {"embeddings": backbone.embeddings, **layers}
    return [(f"{p}.{n}", t) for p, module in parts.items() for n, t in module.state_dict().items()]


# ------------------------------------------------------------------------------------------------------ the cache


def _encode_key(key: Key) -> bytes:
    return (key if isinstance(key, str) else json.dumps(list(key), ensure_ascii=False)).encode("utf8")


def _decode_key(raw: bytes, pairs: bool) -> Key:
    return tuple(json.loads(raw)) if pairs else raw.decode("utf8")


def pair_key(x: Any) -> tuple[str, str]:
    """A cross-encoder input (a tuple or list) as the hashable ``(query, document)`` its caches are keyed by."""
    if isinstance(x, str) or not isinstance(x, (tuple, list)) or len(x) != 2:
        raise ValueError(f"a cross-encoder input is a (query, document) pair, got {x!r:.80}")
    if not all(isinstance(t, str) for t in x):
        raise ValueError(f"a (query, document) pair holds two strings, got {x!r:.80}")
    return (x[0], x[1])


def _as_key(x: Any, pairs: bool) -> Key:
    if pairs:
        return pair_key(x)
    if not isinstance(x, str):
        raise ValueError(f"the partial-training cache holds texts (str), got {type(x).__name__}: {x!r:.80}")
    return x


class LayerStateCache:
    """The hidden states entering layer ``frozen_layers`` of a BERT ``Transformer`` per distinct text (or (query,
    document) pair, ``pairs``) in a folder on disk (``None``: temporary), reused across runs; ``dtype`` float16 or
    float32.

    Per key the token ids (padding dropped) and the states, computed in eval mode by ``transformer`` (``None``: opened
    read-only, a missing key raises ``KeyError``). ``overwrite`` rebuilds a folder of other settings (else ValueError);
    don't rebuild one another process uses. File format and crash safety: ``docs/recipes.md``."""

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
        choice("dtype", dtype, DTYPES)
        self.batch_size = positive_int("batch_size", batch_size)
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
        self.encoder, self._checked = transformer, None
        if transformer is None:
            if frozen_layers is not None:
                raise ValueError("frozen_layers is read from the folder when no transformer is given")
            self.meta = self._read_meta()
            if self.meta is None:
                raise ValueError(f"{self.folder!r} holds no layer-state cache (no {META})")
        else:
            backbone = check_partial_transformer(transformer)
            num_layers = len(backbone.encoder.layer)
            frozen_layers = check_layers("frozen_layers", frozen_layers, 0, num_layers - 1, num_layers)
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
            with locked(self._path(LOCK)):
                found = self._read_meta()
                differ = {k: (found.get(k), wanted[k]) for k in _COMPARED if found.get(k) != wanted[k]} if found else {}
                if differ and not overwrite:
                    raise ValueError(
                        f"the layer-state cache in {self.folder!r} was built with other settings (found, wanted): "
                        f"{differ}; pass overwrite=True to rebuild it, or use another folder"
                    )
                if found is None or differ:
                    self._create(wanted)
                self.meta = self._read_meta()
            # (encoder id, weights token) last checked against the fingerprint: a cheap re-check before computing
            self._checked = (id(transformer), _weights_token(transformer, frozen_layers))
        #: L - N: the layer whose input states are cached
        self.frozen_layers = int(self.meta["frozen_layers"])
        self.max_seq_length, self.hidden_size = self.meta["max_seq_length"], int(self.meta["hidden_size"])
        self.fingerprint, self.pairs = self.meta["fingerprint"], self.meta["keys"] == "pair"
        self._np_dtype = np.dtype(self.meta["dtype"])
        self._reset()
        self._load_index()

    def _path(self, name: str) -> str:
        return os.path.join(self.folder, name)

    def _corrupt(self, problem: str) -> CorruptFileError:
        return CorruptFileError(f"{problem}: the layer-state cache is corrupted; delete {self.folder!r} to rebuild it")

    def _read_json(self, name: str) -> dict:
        remedy = f"delete {self.folder!r} to rebuild the layer-state cache"
        return read_checked(self._path(name), lambda path: dict(json.loads(Path(path).read_bytes())), remedy)

    def _write_json(self, name: str, obj: dict, indent: int | None = None) -> None:
        atomic_write(self._path(name), json.dumps(obj, indent=indent).encode())

    def _read_meta(self) -> dict | None:
        if not os.path.isfile(self._path(META)):
            return None
        meta = self._read_json(META)
        if meta.get("format") != FORMAT:
            raise ValueError(f"{self._path(META)!r} is not a layer-state cache (format {meta.get('format')!r})")
        return meta

    def _create(self, meta: dict) -> None:
        for name in (META, INDEX, *DATA_FILES):  # meta first: a folder without it holds no cache
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._path(name))
        for name in DATA_FILES:
            atomic_write(self._path(name), b"")
        self._write_index(0, 0, 0)
        self._write_json(META, meta, indent=1)

    def _write_index(self, keys: int, tokens: int, key_bytes: int) -> None:
        self._write_json(INDEX, {"keys": keys, "tokens": tokens, "key_bytes": key_bytes})

    def _sizes(self, n_keys: int, n_tokens: int, n_key_bytes: int) -> dict[str, int]:
        """The bytes of each data file that ``n_keys`` keys of ``n_tokens`` tokens and ``n_key_bytes`` take."""
        states = n_tokens * self.hidden_size * self._np_dtype.itemsize
        return {STATES: states, TOKENS: n_tokens * 4, KEYS: n_key_bytes, ROWS: n_keys * 16}

    def _reset(self) -> None:
        self._rows: dict[Key, int] = {}
        self._offsets = np.zeros(1, np.int64)  # token offsets of the rows, n_keys + 1
        self._key_bytes = 0
        self._states: np.memmap | None = None
        self._ids: np.memmap | None = None

    def _load_index(self) -> None:
        """Catch up with what is committed on disk (only the keys added since the last look are read)."""
        if self._read_meta() != self.meta:
            raise ValueError(f"the layer-state cache in {self.folder!r} was rebuilt with other settings meanwhile")
        counts = self._read_json(INDEX)
        n_keys, n_tokens, n_key_bytes = int(counts["keys"]), int(counts["tokens"]), int(counts["key_bytes"])
        if n_keys < len(self._rows):
            self._reset()
        for name, needed in self._sizes(n_keys, n_tokens, n_key_bytes).items():
            have = os.path.getsize(self._path(name))
            if have < needed:
                raise self._corrupt(f"{self._path(name)!r} is shorter than its index says ({have} < {needed} bytes)")
        old = len(self._rows)
        if n_keys > old:
            ends = np.fromfile(self._path(ROWS), dtype=np.int64, count=2 * (n_keys - old), offset=old * 16)
            ends = ends.reshape(-1, 2)
            with open(self._path(KEYS), "rb") as f:
                f.seek(self._key_bytes)
                raw = f.read(n_key_bytes - self._key_bytes)
            starts = np.concatenate([[self._key_bytes], ends[:-1, 0]]) - self._key_bytes
            for i, (a, b) in enumerate(zip(starts, ends[:, 0] - self._key_bytes)):
                self._rows[_decode_key(raw[a:b], self.pairs)] = old + i
            self._offsets = np.concatenate([self._offsets, ends[:, 1]])
            self._key_bytes = n_key_bytes
        if int(self._offsets[-1]) != n_tokens:
            raise self._corrupt(f"{self._path(ROWS)!r} disagrees with {INDEX}")
        if n_tokens and (self._states is None or len(self._states) != n_tokens):
            shape = (n_tokens, self.hidden_size)
            self._states = np.memmap(self._path(STATES), dtype=self._np_dtype, mode="r", shape=shape)
            self._ids = np.memmap(self._path(TOKENS), dtype=np.int32, mode="r", shape=(n_tokens,))

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
            raise KeyError(
                "not in the layer-state cache (was it in the training data?) and no encoder to compute it: "
                f"{new[0]!r:.100}"
            )
        checked = (id(self.encoder), _weights_token(self.encoder, self.frozen_layers))
        changed = checked != self._checked and state_fingerprint(self.encoder, self.frozen_layers) != self.fingerprint
        self._checked = checked
        if changed or self.encoder.max_seq_length != self.max_seq_length:
            raise ValueError(
                "the encoder no longer matches the layer-state cache (its frozen weights, tokenizer or "
                "max_seq_length changed since the cache was opened)"
            )
        with locked(self._path(LOCK)):
            self._load_index()  # another writer may have committed meanwhile
            new = [k for k in new if k not in self._rows]
            if new:
                self._append(new)
        return len(new)

    def rows(self, keys: Sequence[Any]) -> list[int]:
        """The row of each key, computing the missing ones first (with the encoder; without: ``KeyError``)."""
        keys = [_as_key(x, self.pairs) for x in keys]
        self.extend(keys)
        return [self._rows[k] for k in keys]

    def _row(self, data: np.memmap | None, row: int) -> np.ndarray:
        if data is None:
            raise IndexError(f"row {row} of an empty cache")
        return data[self._offsets[row] : self._offsets[row + 1]]

    def token_ids(self, row: int) -> np.ndarray:
        """The cached token ids of key ``row`` (no padding)."""
        return self._row(self._ids, row)

    def states(self, row: int) -> np.ndarray:
        """The cached states of key ``row``, ``(n_tokens, hidden_size)`` of the storage dtype (a memmap view)."""
        return self._row(self._states, row)

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

    def _compute(self, keys: Sequence[Key]) -> Iterator[list[tuple[int, np.ndarray, np.ndarray]]]:
        """Per batch (longest keys first): (position in ``keys``, token ids, states) of each of its keys."""
        transformer = self.encoder
        device = next(transformer.auto_model.parameters()).device
        with evaluating(transformer), torch.inference_mode():
            for idx in longest_first(keys, self.batch_size, "layer states", self.show_progress_bar):
                features = transformer.preprocess([keys[i] for i in idx])
                if "attention_mask" not in features or "input_ids" not in features:
                    raise ValueError("the Transformer's preprocess gave no input_ids / attention_mask")
                mask, ids = features["attention_mask"].bool(), features["input_ids"]
                hidden = states_entering(transformer, batch_to_device(features, device), self.frozen_layers)
                hidden = hidden.float().cpu()
                yield [
                    (i, ids[j][mask[j]].numpy().astype(np.int32), hidden[j][mask[j]].numpy().astype(self._np_dtype))
                    for j, i in enumerate(idx)
                ]

    def _append(self, keys: list[Key]) -> None:
        """Append ``keys``' states (in the order computed: longest first) and commit them, at the end and about
        every ``commit_seconds`` of computing (the caller holds the lock and has caught up with the index)."""
        counts = [len(self._rows), int(self._offsets[-1]), self._key_bytes]
        committed = self._sizes(*counts)
        with contextlib.ExitStack() as stack:
            files = {name: stack.enter_context(open(self._path(name), "r+b")) for name in DATA_FILES}
            for name, f in files.items():
                f.truncate(committed[name])  # drop what a crashed writer left beyond the committed index
                f.seek(committed[name])
            last = time.monotonic()
            for batch in self._compute(keys):
                for p, t, s in batch:
                    raw = _encode_key(keys[p])
                    files[STATES].write(np.ascontiguousarray(s).tobytes())
                    files[TOKENS].write(np.ascontiguousarray(t, dtype=np.int32).tobytes())
                    files[KEYS].write(raw)
                    counts = [counts[0] + 1, counts[1] + len(t), counts[2] + len(raw)]
                    files[ROWS].write(np.array([counts[2], counts[1]], dtype=np.int64).tobytes())
                if time.monotonic() - last > self.commit_seconds:
                    self._commit(files, counts)
                    last = time.monotonic()
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
    """Input module standing in for a BERT ``Transformer`` in partial training: the lower layers' states come from a
    :class:`LayerStateCache`, the top layers are the ``Transformer``'s own (shared, not copied).

    ``preprocess`` maps keys to cache rows (right-padded token ids and mask); ``forward`` runs layers
    ``frozen_layers..L-1`` and writes ``token_embeddings``. Prompts, ``processing_kwargs`` and another ``max_length``
    are refused. It cannot be saved (save the model it was made from)."""

    save_in_root = False

    def __init__(self, transformer: Transformer, cache: LayerStateCache) -> None:
        super().__init__()
        backbone = check_partial_transformer(transformer)
        if cache.max_seq_length != transformer.max_seq_length:
            raise ValueError(
                f"the cache holds states of texts cut at max_seq_length={cache.max_seq_length}, the Transformer cuts "
                f"at {transformer.max_seq_length}"
            )
        if cache.hidden_size != backbone.config.hidden_size or cache.meta["num_layers"] != len(backbone.encoder.layer):
            raise ValueError("the cache was made with another backbone (hidden size or layer count differ)")
        self.transformer, self.cache = transformer, cache

    @property
    def modalities(self) -> list[str]:
        return ["text"]

    @property
    def frozen_layers(self) -> int:
        return self.cache.frozen_layers

    @property
    def train_layers(self) -> int:
        return len(self.transformer.auto_model.encoder.layer) - self.frozen_layers

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
        ids = [torch.from_numpy(self.cache.token_ids(row).astype(np.int64)) for row in rows]
        input_ids = pad_sequence(ids, batch_first=True, padding_value=self.tokenizer.pad_token_id or 0)
        attention_mask = (torch.arange(input_ids.shape[1])[None, :] < torch.from_numpy(lengths)[:, None]).long()
        rows_t = torch.tensor(rows, dtype=torch.long)
        return {"input_ids": input_ids, "attention_mask": attention_mask, "cache_rows": rows_t, "modality": "text"}

    def forward(self, features: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
        if "unpaired_texts" in features:
            raise ValueError("a cross-encoder scores (query, document) pairs, got single texts")
        backbone = self.transformer.auto_model
        mask = features["attention_mask"]
        states = self.cache.gather(features["cache_rows"].tolist(), mask.shape[1])
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
    shared with ``model``, so training it trains ``model`` in place (which then saves and loads with no cache).

    Freezes ``model``'s embeddings and lower ``L - train_layers`` layers (left so). ``model``: a SentenceTransformer or
    a CrossEncoder with a separate head, BERT backbone. ``texts`` (pairs for a CrossEncoder) are cached now, others on
    first use unless ``encode_missing=False`` (then ``KeyError``). ``cache``: a :class:`LayerStateCache` of this model's
    frozen part, else one in ``cache_dir`` (``None``: temporary) with ``dtype`` / ``overwrite`` as in the cache. Returns
    a model of ``model``'s class (a CrossEncoder keeps its ``activation_fn``) giving its outputs up to the storage
    rounding."""
    positive_int("batch_size", batch_size)
    modules = list(model)
    if not modules:
        raise ValueError("partial training needs a model with modules")
    transformer = modules[0]
    backbone = check_partial_transformer(transformer)
    num_layers = len(backbone.encoder.layer)
    frozen = num_layers - check_layers("train_layers", train_layers, 1, num_layers, num_layers)
    hooked = [i for i, m in enumerate(backbone.encoder.layer[:frozen]) if m._forward_pre_hooks or m._forward_hooks]
    if hooked:  # e.g. a MoL token_layer below the trained layers: the cached states would not follow it
        raise ValueError(f"layers {hooked} under the top {train_layers} trained have hooks the cache cannot hold")
    pairs = isinstance(model, CrossEncoder)
    if pairs and len(modules) < 2:
        raise ValueError("partial training of a CrossEncoder needs a head after its Transformer (Pooling + head)")
    if not pairs and not isinstance(model, SentenceTransformer):
        raise ValueError(
            f"partial training handles SentenceTransformer and CrossEncoder models, got {type(model).__name__}"
        )
    if cache is None:
        cache = LayerStateCache(cache_dir, transformer, frozen, pairs=pairs, dtype=dtype, overwrite=overwrite)
    else:
        _check_cache_fits(cache, cache_dir, transformer, pairs, frozen)
    cache.batch_size, cache.show_progress_bar = batch_size, show_progress_bar
    cache.encoder = transformer  # computes the given texts now
    try:
        cache.extend(texts)
    finally:
        if not encode_missing:
            cache.encoder = None
    freeze_lower_layers(backbone, frozen)
    stand_in_modules = [PartialTransformer(transformer, cache), *modules[1:]]
    if pairs:
        return type(model)(modules=stand_in_modules, device=str(model.device), activation_fn=model.activation_fn)
    return SentenceTransformer(modules=stand_in_modules, device=str(model.device))


def _check_cache_fits(
    cache: LayerStateCache, cache_dir: Any, transformer: Transformer, pairs: bool, frozen: int
) -> None:
    """A ``ValueError`` listing why ``cache`` cannot serve ``transformer``'s stand-in (one with ``frozen`` layers)."""
    if cache_dir is not None and os.path.abspath(os.fspath(cache_dir)) != os.path.abspath(cache.folder):
        raise ValueError(f"cache (in {cache.folder!r}) and cache_dir={os.fspath(cache_dir)!r} disagree: pass one")
    problems = []
    if cache.pairs != pairs:
        problems.append(f"keys are {'pairs' if cache.pairs else 'texts'}, the model needs the other")
    if cache.frozen_layers != frozen:
        problems.append(f"it caches the input of layer {cache.frozen_layers}, the model's train_layers needs {frozen}")
    if cache.max_seq_length != transformer.max_seq_length:
        problems.append(f"max_seq_length {cache.max_seq_length} != the model's {transformer.max_seq_length}")
    if not problems and cache.fingerprint != state_fingerprint(transformer, frozen):
        problems.append("it was computed with other frozen weights or another tokenizer")
    if problems:
        raise ValueError("the layer-state cache does not fit this model: " + "; ".join(problems))
    cache._checked = (id(transformer), _weights_token(transformer, frozen))
