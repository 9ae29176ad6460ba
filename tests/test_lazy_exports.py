"""The packages' public names are imported on first use: a light submodule loads neither sentence-transformers nor
torch, and every public name resolves."""

from __future__ import annotations

import subprocess
import sys

import pytest

import pyterrier_prob
import st_extensions
from st_extensions.lazy import lazy_exports

PROBE = """
import sys
import pyterrier_prob, pyterrier_prob.validation, st_extensions, st_extensions.checks
print(sorted(m for m in ("sentence_transformers", "torch", "transformers") if m in sys.modules))
"""


def test_a_light_submodule_loads_neither_sentence_transformers_nor_torch():
    out = subprocess.check_output([sys.executable, "-c", PROBE], text=True)
    assert out.split() == ["[]"]


@pytest.mark.parametrize("package", [st_extensions, pyterrier_prob], ids=lambda p: p.__name__)
def test_every_public_name_resolves_and_is_kept(package):
    names = [n for n in package.__all__ if n != "__version__"]
    assert len(names) == len(set(names)) >= 12
    for name in names:
        value = getattr(package, name)
        assert name in dir(package) and vars(package)[name] is value  # kept after the first use
    with pytest.raises(AttributeError, match=f"module '{package.__name__}' has no attribute 'not_a_name'"):
        package.not_a_name  # noqa: B018


def test_lazy_exports_imports_once_and_names_unknown_names(monkeypatch):
    module = type(sys)("lazy_probe")
    monkeypatch.setitem(sys.modules, "lazy_probe", module)
    names, getattr_, dir_ = lazy_exports("lazy_probe", {"math": "sqrt pi", "os.path": "join"})
    assert names == ["sqrt", "pi", "join"]
    module.__getattr__ = getattr_
    import math
    import os.path

    assert "pi" not in vars(module) and module.pi == math.pi and vars(module)["pi"] == math.pi  # kept once used
    assert module.sqrt is math.sqrt and module.join is os.path.join
    assert {"sqrt", "pi", "join"} <= set(dir_())
    with pytest.raises(AttributeError, match="module 'lazy_probe' has no attribute 'cos'"):
        module.cos  # noqa: B018
