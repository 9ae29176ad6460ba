"""Saving and loading of our sentence-transformers modules: a JSON config plus safetensors weights, never pickle."""

from __future__ import annotations

import json
import os
import struct
from typing import Any

from safetensors.torch import load_file
from sentence_transformers.base.modules import Module
from torch import Tensor

from st_extensions.atomic import CorruptFileError

__all__ = ["WEIGHTS_NAME", "SafetensorsModule", "check_safetensors_file"]

WEIGHTS_NAME = "model.safetensors"
_MAX_HEADER = 100_000_000  # safetensors' own limit on the JSON header
#: what to do with a truncated or corrupt model file
REMEDY = "delete the model folder and save, download or train the model again"


def check_safetensors_file(path: str | os.PathLike, remedy: str = REMEDY) -> dict[str, tuple[int, ...]]:
    """``{tensor name: shape}`` from a safetensors file's header, checking that the file holds every tensor it lists
    (else a :class:`~st_extensions.atomic.CorruptFileError` naming it and ``remedy``). Reads the header only."""
    path = os.fspath(path)
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise ValueError(f"it has {len(prefix)} bytes, not even the 8-byte header length")
            (n,) = struct.unpack("<Q", prefix)
            if n > min(_MAX_HEADER, size - 8):
                raise ValueError(f"its header claims {n} bytes but the file has {size}")
            header = json.loads(f.read(n))
        if not isinstance(header, dict):
            raise ValueError("its header is not a JSON object")
        tensors = {name: info for name, info in header.items() if name != "__metadata__"}
        end = max((int(info["data_offsets"][1]) for info in tensors.values()), default=0)
        shapes = {name: tuple(int(d) for d in info["shape"]) for name, info in tensors.items()}
    except (OSError, ValueError, KeyError, IndexError, TypeError, UnicodeDecodeError) as e:
        raise CorruptFileError(
            f"{path!r} is not a complete safetensors file (truncated or corrupt?): {e}; {remedy}"
        ) from e
    if size < 8 + n + end:
        raise CorruptFileError(
            f"{path!r} is truncated: its header lists tensors up to byte {8 + n + end} but the file has {size} bytes; "
            + remedy
        )
    return shapes


class SafetensorsModule(Module):
    """A :class:`~sentence_transformers.base.modules.Module` saved as ``config.json`` + ``model.safetensors``;
    :meth:`load` refuses pickled ``.bin`` weights and weights whose names or shapes do not match the config."""

    config_file_name = "config.json"
    #: learning rate of the module's parameters under :func:`pyterrier_prob.training.fine_tune` (the encoder keeps
    #: the trainer's); chosen on nfcorpus train/dev by ``benchmarks/recipe_search.py`` (README, training recipes)
    learning_rate: float = 3e-4

    def _checked_embeddings(self, x: Any, dim: int, what: str = "embeddings") -> Tensor:
        """``x`` as a ``(batch, dim)`` tensor in the dtype of the module's weights; else a ValueError naming it."""
        if not isinstance(x, Tensor) or x.ndim != 2 or x.shape[-1] != dim:
            shape = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
            other_dim = isinstance(x, Tensor) and x.ndim == 2
            hint = ": it was built for another embedding dimension" if other_dim else ""
            raise ValueError(f"{type(self).__name__} expects {what} of shape (batch, {dim}), got {shape}{hint}")
        return x.to(next(self.parameters()).dtype)

    def save(self, output_path: str, *args, safe_serialization: bool = True, **kwargs) -> None:
        self.save_config(output_path)
        self.save_torch_weights(output_path, safe_serialization=True)

    @classmethod
    def load(cls, model_name_or_path: str, subfolder: str = "", **kwargs) -> SafetensorsModule:
        hub_kwargs = {k: kwargs[k] for k in ("token", "cache_folder", "revision", "local_files_only") if k in kwargs}
        config = cls.load_config(model_name_or_path, subfolder=subfolder, **hub_kwargs)
        module = cls(**config)
        path = cls.load_file_path(model_name_or_path, filename=WEIGHTS_NAME, subfolder=subfolder, **hub_kwargs)
        if path is None or not os.path.isfile(path):
            raise ValueError(
                f"{cls.__name__} in {os.path.join(model_name_or_path, subfolder)!r} has no {WEIGHTS_NAME}; "
                "only safetensors weights are loaded (never pickled .bin files)"
            )
        check_safetensors_file(path)
        try:
            state = load_file(path)
        except Exception as e:  # safetensors' own errors do not name the file
            raise ValueError(f"{path!r} could not be read as safetensors (corrupt?): {e}") from e
        expected = module.state_dict()
        bad = sorted(k for k in expected if k not in state or state[k].shape != expected[k].shape)
        extra = sorted(set(state) - set(expected))
        if bad or extra:
            shapes = {k: tuple(v.shape) for k, v in state.items()}
            raise ValueError(
                f"{cls.__name__} weights in {path!r} do not match its config {module!r}: mismatched or missing "
                f"{bad}, unexpected {extra}; got {shapes}"
            )
        module.load_state_dict(state)
        return module
