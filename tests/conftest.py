import logging
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


class DeprecatedTokenizeLog(logging.Handler):
    """Collects sentence-transformers' log lines saying that a deprecated ``tokenize`` ran instead of ``preprocess``
    (a logger message, not a Python warning, so the ``filterwarnings`` errors of pyproject.toml cannot catch it)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "`tokenize`" in message and "deprecated" in message:
            self.messages.append(message)


@pytest.fixture(autouse=True)
def _no_deprecated_tokenize():
    """Fail a test during which our code sent sentence-transformers down its deprecated ``tokenize`` path."""
    log, logger = DeprecatedTokenizeLog(), logging.getLogger("sentence_transformers")
    logger.addHandler(log)
    try:
        yield log
    finally:
        logger.removeHandler(log)
    assert not log.messages, f"sentence-transformers' deprecated tokenize path ran: {log.messages[0]}"


@pytest.fixture(scope="session")
def minilm_path() -> str:
    from st_extensions import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def base_model(minilm_path):
    from st_extensions import load_model

    return load_model(minilm_path, device="cpu")


def write_beir_folder(folder, splits: dict[str, int], docs_per_query: int = 6, extra_docs: int = 60, seed: int = 0):
    """A small BEIR folder cut from nfcorpus (:func:`pyterrier_prob.collections.write_beir_sample`); returns
    ``{"docs": n_docs, "queries": {split: n}, "qrels": {split: n_rows}}`` (what loading must give)."""
    from pyterrier_prob.collections import write_beir_sample

    return write_beir_sample(folder, splits, docs_per_query=docs_per_query, extra_docs=extra_docs, seed=seed)


@pytest.fixture(scope="session")
def small_beir(tmp_path_factory):
    """A small BEIR folder (nfcorpus cut: train 24, dev 12, test 12 queries; ~150 documents) for end-to-end runs."""
    folder = tmp_path_factory.mktemp("small_beir")
    info = write_beir_folder(folder, {"train": 24, "dev": 12, "test": 12})
    return folder, info


@pytest.fixture(scope="session")
def small_beir_no_train_no_dev(tmp_path_factory):
    """A small BEIR folder with only a test split (20 queries)."""
    folder = tmp_path_factory.mktemp("small_beir_test_only")
    info = write_beir_folder(folder, {"test": 20})
    return folder, info
