"""The one atomic writer of pyterrier-prob: :mod:`st_extensions.atomic` (files, index directories, model folders,
recovery of a directory a killed writer left aside), re-exported here, and :func:`save_figure` for plots."""

from __future__ import annotations

import os
from typing import Any

from st_extensions.atomic import (
    DIR_MODE,
    FILE_MODE,
    CorruptFileError,
    atomic_directory,
    atomic_write,
    clean_stale_temporaries,
    make_dirs,
    read_checked,
    recover_directory,
)

__all__ = [
    "FILE_MODE",
    "DIR_MODE",
    "atomic_write",
    "atomic_directory",
    "CorruptFileError",
    "read_checked",
    "clean_stale_temporaries",
    "make_dirs",
    "recover_directory",
    "save_figure",
]


def save_figure(fig: Any, path: str | os.PathLike, dpi: int = 120) -> str:
    """Save a matplotlib ``Figure`` as PNG at ``path`` atomically (0644), with an Agg canvas (no display)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)
    return atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=dpi))
