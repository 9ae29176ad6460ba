"""A guarded model loader: our own Module classes are allowed, any other foreign class is refused.

:func:`load_model` resolves the class references of a saved model's ``modules.json`` (and a Router's
``router_config.json``) to the registered classes of this package (:func:`register_module`), with
``trust_remote_code=False``, and loads whole safetensors weights only.
"""

from __future__ import annotations

import contextlib
import fnmatch
import importlib.metadata
import json
import os
import re
import threading
from collections.abc import Iterator
from typing import Any

from packaging.version import Version
from sentence_transformers import CrossEncoder, SentenceTransformer
from torch import nn
from transformers import PreTrainedModel

from st_extensions.atomic import recover_directory
from st_extensions.modules import LinearAdapter, MixtureOfLogits, MultiBranchQueryEncoder, QueryDistributionHead
from st_extensions.modules.safetensors_module import check_safetensors_file

#: Class references (as in ``modules.json``) that :func:`load_model` resolves: :mod:`st_extensions.modules`' classes
#: and those that register themselves (the cross-encoder modules, on ``import st_extensions``).
ALLOWED_MODULES: dict[str, type[nn.Module]] = {}
#: Model classes that :func:`load_model` loads a saved model as when it holds the given module class
#: (class reference as in ``modules.json`` -> a CrossEncoder / SentenceTransformer subclass of ours).
MODEL_CLASSES: dict[str, type] = {}


def register_module(cls: type[nn.Module], model_class: type | None = None) -> type[nn.Module]:
    """Allow ``cls``, one of ours, in :func:`load_model` under the reference ``model.save`` writes for it; a model
    holding it loads as ``model_class`` when given (e.g. a VariationalHead: ``VarCrossEncoder``)."""
    if not cls.__module__.startswith("st_extensions."):
        raise ValueError(f"only st_extensions classes can be registered, got {cls.__module__}.{cls.__name__}")
    ALLOWED_MODULES[f"{cls.__module__}.{cls.__name__}"] = cls
    if model_class is not None:
        MODEL_CLASSES[f"{cls.__module__}.{cls.__name__}"] = model_class
    return cls


for _cls in (QueryDistributionHead, MixtureOfLogits, MultiBranchQueryEncoder, LinearAdapter):
    register_module(_cls)


def _read_json(path: str) -> Any:
    with open(path, encoding="utf8") as f:
        return json.load(f)


def _module_types(path: str) -> list[tuple[str, str]]:
    """(class reference, where it was found) for every module of the saved model at ``path``."""
    modules_json = os.path.join(path, "modules.json")
    if not os.path.isfile(modules_json):
        raise ValueError(f"{path!r} is not a saved sentence-transformers model: it has no modules.json")
    try:
        entries = _read_json(modules_json)
        found = [(entry["type"], modules_json) for entry in entries]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"corrupt modules.json in {path!r}: {e}") from e
    for entry in entries:
        router_config = os.path.join(path, entry.get("path", ""), "router_config.json")
        if os.path.isfile(router_config):
            found += [(t, router_config) for t in _read_json(router_config).get("types", {}).values()]
    return found


#: Pickled weight files (transformers' and torch's) that :func:`load_model` refuses to rely on.
PICKLED_WEIGHTS = (
    "pytorch_model.bin",
    "pytorch_model-*.bin",
    "pytorch_model.bin.index.json",
    "*.pt",
    "*.pth",
    "*.ckpt",
)
_SAFETENSORS = ("model.safetensors", "model.safetensors.index.json")


def _check_files(path: str) -> None:
    """No folder of the model asks for repository code (``auto_map``), every folder with weights has safetensors ones,
    and every safetensors file is complete."""
    for root, _dirs, files in os.walk(path):
        if "config.json" in files:
            try:
                config = _read_json(os.path.join(root, "config.json"))
            except json.JSONDecodeError:
                config = None
            if isinstance(config, dict) and "auto_map" in config:
                raise ValueError(
                    f"{os.path.join(root, 'config.json')!r} asks for repository modeling code (auto_map); "
                    "load_model never runs foreign code: load it with sentence-transformers and "
                    "trust_remote_code=True yourself if you trust it"
                )
        for name in sorted(files):
            if name.endswith(".safetensors"):
                check_safetensors_file(os.path.join(root, name))
        if any(f in files for f in _SAFETENSORS):
            continue
        pickled = sorted(f for f in files if any(fnmatch.fnmatch(f, pat) for pat in PICKLED_WEIGHTS))
        if pickled:
            raise ValueError(
                f"refusing to load {os.path.join(root, pickled[0])!r}: its weights are pickled and "
                f"{os.path.join(root, 'model.safetensors')!r} is missing; load_model reads safetensors weights only "
                "(never pickle, which can run code). Convert the model to safetensors once you trust it (load it "
                "with sentence-transformers and save it again)"
            )


# ---- the internals of sentence-transformers and transformers that loading uses --------------------------------------

#: The versions whose internals :func:`load_model` calls (pyproject's pins): sentence-transformers'
#: ``_load_with_module_classes`` (loading with an allow-list of module classes; private on purpose, its docstring says)
#: and transformers' ``PreTrainedModel._finalize_model_loading`` (hooked to see the weights a checkpoint lacks).
SUPPORTED = {"sentence-transformers": ("6.2", "7"), "transformers": ("5.24", "6")}


def check_internals(versions: dict[str, str] | None = None) -> None:
    """RuntimeError naming the package, its version and the supported range when sentence-transformers or
    transformers is outside :data:`SUPPORTED`, or lacks the internal entry point :func:`load_model` uses (``versions``:
    the installed ones, for a test)."""
    for name, (low, high) in SUPPORTED.items():
        have = (versions or {}).get(name) or importlib.metadata.version(name)
        if not Version(low) <= Version(have) < Version(high):
            raise RuntimeError(
                f"st_extensions.load_model calls internals of {name} that it was written for {low} <= version < "
                f"{high}; {have} is installed: pip install '{name}>={low},<{high}'"
            )
    missing = [
        where
        for where, ok in (
            ("sentence_transformers' SentenceTransformer._load_with_module_classes",
             callable(getattr(SentenceTransformer, "_load_with_module_classes", None))),
            ("transformers' PreTrainedModel._finalize_model_loading (a staticmethod)",
             isinstance(PreTrainedModel.__dict__.get("_finalize_model_loading"), staticmethod)),
        )
        if not ok
    ]  # fmt: skip
    if missing:
        raise RuntimeError(f"st_extensions.load_model needs {' and '.join(missing)}, which this installation lacks")


# ---- weights the config declares but the checkpoint lacks ----------------------------------------------------------

_missing_records = threading.local()
_hook_lock = threading.Lock()
_hook_users = 0


@contextlib.contextmanager
def _record_missing_weights() -> Iterator[list[tuple[str, str, list[str]]]]:
    """Collect ``(model class, checkpoint, missing keys)`` of every transformers model loaded in the block (in this
    thread): transformers only logs the keys it initialised at random because the checkpoint lacks them."""
    global _hook_users
    records: list[tuple[str, str, list[str]]] = []
    check_internals()
    original = PreTrainedModel.__dict__["_finalize_model_loading"]
    with _hook_lock:
        if _hook_users == 0:

            def finalize(model: Any, load_config: Any, loading_info: Any) -> Any:
                info = original.__func__(model, load_config, loading_info)
                out = getattr(_missing_records, "records", None)
                missing = sorted(getattr(info, "missing_keys", ()) or ())
                if out is not None and missing:
                    source = str(getattr(load_config, "pretrained_model_name_or_path", "?"))
                    out.append((type(model).__name__, source, missing))
                return info

            PreTrainedModel._finalize_model_loading = staticmethod(finalize)
        _hook_users += 1
    previous = getattr(_missing_records, "records", None)
    _missing_records.records = records
    try:
        yield records
    finally:
        _missing_records.records = previous
        with _hook_lock:
            _hook_users -= 1
            if _hook_users == 0:
                PreTrainedModel._finalize_model_loading = original


def _compress_keys(keys: list[str], limit: int = 6) -> str:
    """``encoder.layer.{6, 7}.output.dense.bias``-style summary of parameter names."""
    groups: dict[str, list[str]] = {}
    for k in keys:
        m = re.match(r"^(.*?\.)(\d+)(\..*)$", k)
        if m:
            groups.setdefault(m[1] + "{}" + m[3], []).append(m[2])
        else:
            groups.setdefault(k, [])
    parts = [pat.format("{" + ", ".join(sorted(set(n), key=int)) + "}") if n else pat for pat, n in groups.items()]
    more = f" and {len(parts) - limit} more" if len(parts) > limit else ""
    return ", ".join(parts[:limit]) + more


def load_model(path: str, *, cross_encoder: bool | None = None, **kwargs: Any) -> SentenceTransformer | CrossEncoder:
    """Load a saved model (local folder) that may contain this package's Modules, refusing any other foreign class.

    ``cross_encoder``: load as a CrossEncoder (default: as its config says); a module in :data:`MODEL_CLASSES` picks
    that class (a VariationalHead: ``VarCrossEncoder``). ``**kwargs`` go to the class; ``trust_remote_code`` is refused.
    ValueError: a module class neither ``sentence_transformers.*`` nor in :data:`ALLOWED_MODULES`, repository code, not
    a saved model, only pickled weights (:data:`PICKLED_WEIGHTS`), a truncated / corrupt safetensors file, or declared
    weights the checkpoint lacks (which transformers would initialise at random and only log)."""
    if "trust_remote_code" in kwargs:
        raise ValueError("load_model does not take trust_remote_code: it allows our own module classes only")
    path = os.fspath(path)
    if not os.path.exists(path):
        recover_directory(path)  # a previous version a killed writer left aside
    if not os.path.isdir(path):
        raise ValueError(f"load_model expects a local model directory, got {path!r}")
    types = _module_types(path)
    foreign = [
        (t, where) for t, where in types if not t.startswith("sentence_transformers.") and t not in ALLOWED_MODULES
    ]
    if foreign:
        listed = "; ".join(f"{t!r} (in {where})" for t, where in foreign)
        raise ValueError(
            f"refusing to load {path!r}: it references module classes outside sentence_transformers and "
            f"st_extensions: {listed}. Only these of ours are allowed: {sorted(ALLOWED_MODULES)}"
        )
    _check_files(path)
    if cross_encoder is None:
        config_path = os.path.join(path, "config_sentence_transformers.json")
        cross_encoder = os.path.isfile(config_path) and _read_json(config_path).get("model_type") == "CrossEncoder"
    cls = CrossEncoder if cross_encoder else SentenceTransformer
    special = sorted({MODEL_CLASSES[t].__name__: MODEL_CLASSES[t] for t, _ in types if t in MODEL_CLASSES}.items())
    if len(special) > 1:
        raise ValueError(f"{path!r} holds modules of several model classes: {[name for name, _ in special]}")
    if special and issubclass(special[0][1], cls):
        cls = special[0][1]  # e.g. VarCrossEncoder for a CrossEncoder with a VariationalHead
    with _record_missing_weights() as missing:
        model = cls._load_with_module_classes(path, module_classes=dict(ALLOWED_MODULES), **kwargs)
    if missing:
        cls_name, source, keys = missing[0]
        weights = [os.path.join(source, f) for f in _SAFETENSORS if os.path.isfile(os.path.join(source, f))]
        source = weights[0] if weights else source
        raise ValueError(
            f"refusing to load {path!r}: the checkpoint {source!r} lacks {len(keys)} weights that its config "
            f"declares for {cls_name} ({_compress_keys(keys)}); they would be initialised at random. Does the "
            "config (e.g. num_hidden_layers) match the saved weights?"
        )
    return model
