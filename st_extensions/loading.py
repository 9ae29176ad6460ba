"""A guarded model loader: our own Module classes are allowed, any other foreign class is refused.

sentence-transformers >= 6 imports a module class from outside ``sentence_transformers.*`` only with
``trust_remote_code=True``, which would also allow any other class (or a repository's own modeling code).
:func:`load_model` reads the model's ``modules.json`` (and a Router's ``router_config.json``), checks every
class reference, and resolves ours to the already-imported classes of this package, so
``trust_remote_code`` stays ``False`` for everything else.
"""

from __future__ import annotations

import json
import os
from typing import Any

from sentence_transformers import CrossEncoder, SentenceTransformer
from torch import nn

from st_extensions.cross_encoder import VarCrossEncoder, VariationalHead
from st_extensions.modules import MixtureOfLogits, MultiBranchQueryEncoder, QueryDistributionHead

#: Class references (as written in ``modules.json``) that :func:`load_model` resolves without
#: ``trust_remote_code``. Later modules of this package register here.
ALLOWED_MODULES: dict[str, type[nn.Module]] = {}


def register_module(cls: type[nn.Module]) -> type[nn.Module]:
    """Allow ``cls``, one of ours, in :func:`load_model` under the reference ``model.save`` writes for it."""
    if not cls.__module__.startswith("st_extensions."):
        raise ValueError(f"only st_extensions classes can be registered, got {cls.__module__}.{cls.__name__}")
    ALLOWED_MODULES[f"{cls.__module__}.{cls.__name__}"] = cls
    return cls


register_module(QueryDistributionHead)
register_module(MixtureOfLogits)
register_module(VariationalHead)
register_module(MultiBranchQueryEncoder)

#: Model classes that :func:`load_model` loads a saved model as when it holds the given module class
#: (class reference as in ``modules.json`` -> a CrossEncoder / SentenceTransformer subclass of ours).
MODEL_CLASSES: dict[str, type] = {f"{VariationalHead.__module__}.{VariationalHead.__name__}": VarCrossEncoder}


def _module_types(path: str) -> list[tuple[str, str]]:
    """(class reference, where it was found) for every module of the saved model at ``path``."""
    modules_json = os.path.join(path, "modules.json")
    if not os.path.isfile(modules_json):
        raise ValueError(f"{path!r} is not a saved sentence-transformers model: it has no modules.json")
    try:
        with open(modules_json, encoding="utf8") as f:
            entries = json.load(f)
        found = [(entry["type"], modules_json) for entry in entries]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"corrupt modules.json in {path!r}: {e}") from e
    for entry in entries:
        router_config = os.path.join(path, entry.get("path", ""), "router_config.json")
        if os.path.isfile(router_config):
            with open(router_config, encoding="utf8") as f:
                found += [(t, router_config) for t in json.load(f).get("types", {}).values()]
    return found


def _check_no_remote_code(path: str) -> None:
    for root, _dirs, files in os.walk(path):
        if "config.json" in files:
            with open(os.path.join(root, "config.json"), encoding="utf8") as f:
                try:
                    config = json.load(f)
                except json.JSONDecodeError:
                    continue
            if isinstance(config, dict) and "auto_map" in config:
                raise ValueError(
                    f"{os.path.join(root, 'config.json')!r} asks for repository modeling code (auto_map); "
                    "load_model never runs foreign code: load it with sentence-transformers and "
                    "trust_remote_code=True yourself if you trust it"
                )


def load_model(path: str, *, cross_encoder: bool | None = None, **kwargs: Any) -> SentenceTransformer | CrossEncoder:
    """Load a saved model that may contain this package's Modules, refusing any other foreign class.

    Args:
        path: a local directory written by ``model.save(...)`` / the trainer.
        cross_encoder: load as a :class:`~sentence_transformers.CrossEncoder`; by default a model whose
            ``config_sentence_transformers.json`` says ``"model_type": "CrossEncoder"`` is one. A model holding
            a module listed in :data:`MODEL_CLASSES` loads as that class (a VariationalHead: ``VarCrossEncoder``).
        **kwargs: passed to the model class (``device``, ``model_kwargs``, ...); ``trust_remote_code``
            is not accepted.

    Returns:
        The loaded model, with our modules resolved to the classes of this package.

    Raises:
        ValueError: the model references a module class that is neither ``sentence_transformers.*`` nor
            one of ours (listed in :data:`ALLOWED_MODULES`), needs repository code, or is not a saved model.
    """
    if "trust_remote_code" in kwargs:
        raise ValueError("load_model does not take trust_remote_code: it allows our own module classes only")
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise ValueError(f"load_model expects a local model directory, got {path!r}")
    types = _module_types(path)
    foreign = [
        (t, where)
        for t, where in types
        if not t.startswith("sentence_transformers.") and t not in ALLOWED_MODULES
    ]
    if foreign:
        listed = "; ".join(f"{t!r} (in {where})" for t, where in foreign)
        raise ValueError(
            f"refusing to load {path!r}: it references module classes outside sentence_transformers and "
            f"st_extensions: {listed}. Only these of ours are allowed: {sorted(ALLOWED_MODULES)}"
        )
    _check_no_remote_code(path)
    if cross_encoder is None:
        config_path = os.path.join(path, "config_sentence_transformers.json")
        model_type = None
        if os.path.isfile(config_path):
            with open(config_path, encoding="utf8") as f:
                model_type = json.load(f).get("model_type")
        cross_encoder = model_type == "CrossEncoder"
    cls = CrossEncoder if cross_encoder else SentenceTransformer
    special = sorted({MODEL_CLASSES[t].__name__: MODEL_CLASSES[t] for t, _ in types if t in MODEL_CLASSES}.items())
    if len(special) > 1:
        raise ValueError(f"{path!r} holds modules of several model classes: {[name for name, _ in special]}")
    if special and issubclass(special[0][1], cls):
        cls = special[0][1]  # e.g. VarCrossEncoder for a CrossEncoder with a VariationalHead
    # The loader maps the checked class references to our imported classes; trust_remote_code stays False.
    return cls._load_with_module_classes(path, module_classes=dict(ALLOWED_MODULES), **kwargs)
