"""The command line's console: our own progress bars and the final table, the libraries' chatter only on request
(:func:`setup_console`, which ``pyterrier-prob`` calls; a script or notebook calls it itself, and wraps native code
that prints, such as PISA's indexer, in :func:`native_output_to`)."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import warnings
from collections.abc import Iterator, Sequence

__all__ = [
    "PIN_MEMORY_WARNING",
    "library_bars",
    "native_output_to",
    "quiet_ir_datasets",
    "quiet_libraries",
    "setup_console",
    "verbose",
]

#: the start of torch's harmless DataLoader warning on a machine without a GPU
PIN_MEMORY_WARNING = r"'pin_memory' argument is set as true but no accelerator is found"

_VERBOSE: bool | None = None  # None: not configured (a library user), else the command line's --verbose


def verbose() -> bool:
    """Whether the command line asked for ``--verbose`` (every library message and bar kept)."""
    return _VERBOSE is True


def library_bars() -> bool:
    """Whether the libraries' inner progress bars show: False only after :func:`setup_console` at default verbosity."""
    return _VERBOSE is not False


def quiet_ir_datasets(level: int = logging.WARNING) -> None:
    """Set ir_datasets' loggers (``ir_datasets``, ``ir_datasets.*``) to ``level`` (made first: ir_datasets sets its
    logger to INFO the first time it logs)."""
    with contextlib.suppress(ImportError, AttributeError):  # another ir_datasets layout: the level below still applies
        import ir_datasets

        ir_datasets.log.easy().logger()
    for name in {"ir_datasets", *(n for n in logging.root.manager.loggerDict if n.startswith("ir_datasets."))}:
        logging.getLogger(name).setLevel(level)


def _hf_progress_bars(enabled: bool) -> None:
    """transformers' and huggingface_hub's own bars (loading weights, downloads, writing shards)."""
    from huggingface_hub.utils import disable_progress_bars, enable_progress_bars
    from transformers.utils import logging as hf_logging

    (hf_logging.enable_progress_bar if enabled else hf_logging.disable_progress_bar)()
    (enable_progress_bars if enabled else disable_progress_bars)()


def quiet_libraries() -> None:
    """Hide the Hugging Face bars and ir_datasets' INFO lines (every experiment run, unless ``--verbose``)."""
    _hf_progress_bars(False)
    quiet_ir_datasets(logging.WARNING)


def setup_console(verbose: bool = False) -> None:
    """Configure the console of a command-line run: quiet libraries, or with ``verbose`` every message and bar kept."""
    global _VERBOSE
    _VERBOSE = bool(verbose)
    quiet_ir_datasets(logging.INFO if verbose else logging.WARNING)  # INFO: ir_datasets' own default
    _hf_progress_bars(_VERBOSE)
    warnings.filterwarnings("default" if verbose else "ignore", message=PIN_MEMORY_WARNING, category=UserWarning)


@contextlib.contextmanager
def native_output_to(path: str, fds: Sequence[int] = (2,)) -> Iterator[None]:
    """Send file descriptors ``fds`` (where native libraries such as PISA print) to ``path`` for the duration."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(fd) for fd in fds]
    try:
        with open(path, "ab") as log:
            for fd in fds:
                os.dup2(log.fileno(), fd)
            yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, s in zip(fds, saved):
            os.dup2(s, fd)
            os.close(s)
