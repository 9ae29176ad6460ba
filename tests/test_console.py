"""The command line's console: library chatter silenced at default verbosity, kept with --verbose."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch

from pyterrier_prob import console
from pyterrier_prob.cli import PAPERS, main

PIN_MESSAGE = (
    "'pin_memory' argument is set as true but no accelerator is found, then device pinned memory won't be used."
)


@pytest.fixture
def restore_console(monkeypatch):
    """Give the process back as it was: console mode, ir_datasets' level, Hugging Face bars, warning filters."""
    from transformers.utils import logging as hf_logging

    monkeypatch.setattr(console, "_VERBOSE", console._VERBOSE)
    level = logging.getLogger("ir_datasets").level
    bars = hf_logging.is_progress_bar_enabled()
    with warnings.catch_warnings():  # restores the filters on exit
        yield
    logging.getLogger("ir_datasets").setLevel(level)
    console._hf_progress_bars(bars)


def _recorded(*messages: str) -> list[str]:
    with warnings.catch_warnings(record=True) as record:
        for m in messages:
            warnings.warn(m, UserWarning, stacklevel=1)
    return [str(w.message) for w in record]


def _real_pin_memory_warnings() -> list[str]:
    """The warnings of a DataLoader with pin_memory=True (on a machine without an accelerator, torch's own)."""
    with warnings.catch_warnings(record=True) as record:
        list(torch.utils.data.DataLoader([0, 1], pin_memory=True))
    return [str(w.message) for w in record if "pin_memory" in str(w.message)]


def test_default_verbosity_silences_the_libraries(restore_console, capsys):
    import ir_datasets
    from transformers.utils import logging as hf_logging

    console.setup_console(verbose=False)
    assert not console.verbose() and not console.library_bars()
    assert logging.getLogger("ir_datasets").level == logging.WARNING
    log = ir_datasets.log.easy()
    log.info("opening a file")  # ir_datasets' [INFO] lines
    log.warn("a real problem")
    err = capsys.readouterr().err
    assert "opening a file" not in err and "[WARNING] a real problem" in err
    assert _recorded(PIN_MESSAGE, "another warning") == ["another warning"]
    if not torch.accelerator.is_available():
        assert _real_pin_memory_warnings() == []
    assert not hf_logging.is_progress_bar_enabled()


def test_verbose_keeps_them(restore_console, capsys):
    import ir_datasets
    from transformers.utils import logging as hf_logging

    console.setup_console(verbose=False)
    console.setup_console(verbose=True)  # also undoes a quiet set-up
    assert console.verbose() and console.library_bars()
    assert logging.getLogger("ir_datasets").level == logging.INFO
    ir_datasets.log.easy().info("opening a file")
    assert "[INFO] opening a file" in capsys.readouterr().err
    assert _recorded(PIN_MESSAGE) == [PIN_MESSAGE]
    if not torch.accelerator.is_available():
        assert _real_pin_memory_warnings() and _real_pin_memory_warnings()[0].startswith("'pin_memory' argument")
    assert hf_logging.is_progress_bar_enabled()


def test_library_use_is_unconfigured(monkeypatch):
    monkeypatch.setattr(console, "_VERBOSE", None)
    assert console.library_bars() and not console.verbose()


@pytest.mark.parametrize("paper", list(PAPERS))
def test_cli_sets_the_console_up(paper, restore_console, capsys):
    with pytest.raises(SystemExit):
        main([paper, "--help"])
    assert "--verbose" in capsys.readouterr().out
    assert main([paper, "--steps", "-1"]) == 2  # a bad setting: the console is set up before the check
    assert console._VERBOSE is False and logging.getLogger("ir_datasets").level == logging.WARNING
    assert main([paper, "--steps", "-1", "--verbose"]) == 2
    assert console._VERBOSE is True and logging.getLogger("ir_datasets").level == logging.INFO


@pytest.mark.parametrize("verbose", [False, True])
def test_training_shows_sentence_transformers_inner_bars_only_when_verbose(verbose, base_model, restore_console, capfd):
    from datasets import Dataset

    from pyterrier_prob.training import Recipe, fine_tune
    from st_extensions import build_pebr_model
    from st_extensions.losses import ExpNCELoss

    console.setup_console(verbose=verbose)
    model = build_pebr_model(base_model, family="exp")
    train = Dataset.from_dict(
        {"anchor": [f"query {i}" for i in range(8)], "positive": [f"a document about topic {i}" for i in range(8)]}
    )
    capfd.readouterr()
    losses = fine_tune(model, ExpNCELoss(model), train, Recipe(mode="frozen", steps=2, batch_size=4), desc="tiny")
    assert len(losses) == 2
    err = capfd.readouterr().err
    assert "tiny" in err  # our own bar, always (show_progress=True)
    assert ("Batches" in err) == verbose  # encode's bar over the texts cached for the frozen recipe
    assert ("Computing widget examples" in err) == verbose  # the model card's, while the trainer is made
