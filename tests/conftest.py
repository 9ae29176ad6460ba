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
    """A small BEIR folder cut from nfcorpus: per split the first ``n`` queries that have judged-relevant
    documents, the i-th with up to ``1 + i % docs_per_query`` of its relevant documents (so the number of relevant
    documents varies, as head/torso/tail strata need), plus ``extra_docs`` other documents.

    Returns ``{"docs": n_docs, "queries": {split: n}, "qrels": {split: n_rows}}`` (what loading must give).
    """
    import json
    import pathlib
    import random

    import ir_datasets

    folder = pathlib.Path(folder)
    (folder / "qrels").mkdir(parents=True, exist_ok=True)
    base = ir_datasets.load("beir/nfcorpus")
    queries, counts, rows_by_split, wanted = {}, {}, {}, set()
    for split, n in splits.items():
        ds = ir_datasets.load(f"beir/nfcorpus/{split}")
        texts = {q.query_id: q.text for q in ds.queries_iter()}
        rel: dict[str, list[str]] = {}
        for r in ds.qrels_iter():
            if r.relevance >= 1 and r.query_id in texts:
                rel.setdefault(r.query_id, []).append(r.doc_id)
        chosen = sorted(rel)[:n]
        rows = [(q, d, 1) for i, q in enumerate(chosen) for d in sorted(rel[q])[: 1 + i % docs_per_query]]
        rows_by_split[split] = rows
        wanted |= {d for _, d, _ in rows}
        queries.update({q: texts[q] for q in chosen})
        counts[split] = len(chosen)
    all_ids = [d.doc_id for d in base.docs_iter()]
    rng = random.Random(seed)
    wanted |= set(rng.sample([d for d in all_ids if d not in wanted], extra_docs))
    store = base.docs_store()
    with open(folder / "corpus.jsonl", "w", encoding="utf8") as f:
        for doc_id in sorted(wanted):
            d = store.get(doc_id)
            f.write(json.dumps({"_id": doc_id, "title": d.title, "text": d.text}) + "\n")
    with open(folder / "queries.jsonl", "w", encoding="utf8") as f:
        for qid, text in queries.items():
            f.write(json.dumps({"_id": qid, "text": text}) + "\n")
    for split, rows in rows_by_split.items():
        with open(folder / "qrels" / f"{split}.tsv", "w", encoding="utf8") as f:
            f.write("query-id\tcorpus-id\tscore\n")
            for q, d, s in rows:
                f.write(f"{q}\t{d}\t{s}\n")
    return {"docs": len(wanted), "queries": counts, "qrels": {s: len(r) for s, r in rows_by_split.items()}}


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
