"""Saving and loading of our sentence-transformers modules: a JSON config plus safetensors weights, never pickle."""

from __future__ import annotations

import os

from safetensors.torch import load_file
from sentence_transformers.base.modules import Module

__all__ = ["WEIGHTS_NAME", "SafetensorsModule"]

WEIGHTS_NAME = "model.safetensors"


class SafetensorsModule(Module):
    """A :class:`~sentence_transformers.base.modules.Module` saved as ``config.json`` + ``model.safetensors``.

    :meth:`load` rebuilds the module from its config and refuses a directory without safetensors weights (no
    pickled ``.bin`` fallback) or weights whose names or shapes do not match the config; the error names the
    module's config (its ``repr``), the mismatched tensors and the shapes found.
    """

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
        state = load_file(path)
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
