"""Public names of a package imported on first use (PEP 562 module ``__getattr__``), so that importing one light
submodule (a check, a path) does not load sentence-transformers and torch through the package's ``__init__``."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any


def lazy_exports(package: str, public: dict[str, str]) -> tuple[list[str], Callable[[str], Any], Callable[[], list]]:
    """``(__all__, __getattr__, __dir__)`` for ``package`` whose public names are given per module (``public``: module
    -> the space-separated names it gives to the package); each name is imported once, on first use, then kept in the
    package's namespace. An unknown name raises the AttributeError Python would."""
    exports = {name: module for module, names in public.items() for name in names.split()}

    def __getattr__(name: str) -> Any:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(exports[name]), name)
        vars(sys.modules[package])[name] = value  # imported once
        return value

    def __dir__() -> list[str]:
        return sorted({*vars(sys.modules[package]), *exports})

    return list(exports), __getattr__, __dir__
