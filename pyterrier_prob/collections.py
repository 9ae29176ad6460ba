"""Test collections from an ir_datasets id, a BEIR folder or a TREC folder, with their splits discovered.

Every source gives the same :class:`Collection`: ``splits``, ``topics(split)`` (``qid, query``), ``qrels(split)``
(``qid, docno, label``), ``corpus_iter()`` (``docno, text``: title then body) and ``doc_texts(docnos)``. The layouts and
the split rules: README, "Collections". Errors name the file, the line and what is wrong."""

from __future__ import annotations

import csv
import json
import os
import random
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import ir_datasets
import pandas as pd
import pyterrier as pt

from pyterrier_prob.validation import choice, finite_float

__all__ = [
    "Collection",
    "IrdsCollection",
    "BeirCollection",
    "TrecCollection",
    "load_collection",
    "doc_text",
    "split_topics",
    "choose_splits",
    "SplitChoice",
    "source_splits",
    "HeldOutCollection",
    "write_beir_sample",
]

_DEV_NAMES = ("dev", "validation", "valid", "val")
_TOPICS, _QRELS = ["qid", "query"], ["qid", "docno", "label"]  # the columns of topics and qrels frames


def doc_text(title: str | None, text: str | None) -> str:
    """A document's text as the encoders see it: ``title`` then ``text`` where the collection has both."""
    title, text = (title or "").strip(), text or ""
    return f"{title}\n{text}".strip() if title else text


class Collection:
    """A corpus with judged query splits. Subclasses implement ``_topics``, ``_qrels``, ``corpus_iter``."""

    name: str
    splits: tuple[str, ...]

    def _split_frame(self, split: str, read: Callable[[str], pd.DataFrame], what: str) -> pd.DataFrame:
        choice(f"{self.name} split", split, self.splits)
        frame = read(split)
        if frame.empty:
            raise ValueError(f"{self.name}: split {split!r} has no {what}")
        return frame.reset_index(drop=True)

    def topics(self, split: str) -> pd.DataFrame:
        """``qid, query`` (strings) of a split."""
        return self._split_frame(split, self._topics, "queries")

    def qrels(self, split: str) -> pd.DataFrame:
        """``qid, docno, label`` of a split (``label`` an int)."""
        return self._split_frame(split, self._qrels, "qrels")

    def corpus_iter(self) -> Iterator[dict[str, str]]:  # pragma: no cover - abstract
        raise NotImplementedError

    def doc_texts(self, docnos: Iterable[str]) -> dict[str, str]:
        """``{docno: text}`` of the given documents that exist in the corpus, in the order the docnos came (each
        once): the same whatever the process's string hash, for a caller that iterates over it."""
        want = list(dict.fromkeys(docnos))
        wanted = set(want)
        found = {d["docno"]: d["text"] for d in self.corpus_iter() if d["docno"] in wanted}
        return {d: found[d] for d in want if d in found}

    @cached_property
    def num_docs(self) -> int:
        return sum(1 for _ in self.corpus_iter())

    def _topics(self, split: str) -> pd.DataFrame:  # pragma: no cover - abstract
        raise NotImplementedError

    def _qrels(self, split: str) -> pd.DataFrame:  # pragma: no cover - abstract
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, splits={list(self.splits)})"


# --- ir_datasets ------------------------------------------------------------------------------------------------


class IrdsCollection(Collection):
    """An ir_datasets dataset and its judged sub-datasets (module docstring)."""

    def __init__(self, dataset_id: str) -> None:
        name = dataset_id.removeprefix("irds:").strip("/")
        try:
            ds = ir_datasets.load(name)
        except KeyError as e:
            raise ValueError(f"unknown ir_datasets id {dataset_id!r} (and no such folder): {e}") from e
        self.name = f"irds:{name}"
        registered = sorted(ir_datasets.registry._registered)
        children = {
            k[len(name) + 1 :]: k
            for k in registered
            if k.startswith(name + "/") and "/" not in k[len(name) + 1 :] and _judged(ir_datasets.load(k))
        }
        if children:
            self._split_ids, self._docs_id = children, name
        elif _judged(ds):
            parent = name.rpartition("/")[0]
            if parent and parent in registered and ir_datasets.load(parent).has_docs():
                self._split_ids, self._docs_id = {name.rpartition("/")[2]: name}, parent
            else:
                self._split_ids, self._docs_id = {"test": name}, name
        else:
            raise ValueError(f"{self.name} has no queries with qrels, nor sub-datasets that have them")
        if not ir_datasets.load(self._docs_id).has_docs():
            raise ValueError(f"{self.name} has no documents")
        self.splits = tuple(self._split_ids)

    def _topics(self, split: str) -> pd.DataFrame:
        queries = ir_datasets.load(self._split_ids[split]).queries_iter()
        return pd.DataFrame([(str(q.query_id), getattr(q, "text", None) or q[1]) for q in queries], columns=_TOPICS)

    def _qrels(self, split: str) -> pd.DataFrame:
        qrels = ir_datasets.load(self._split_ids[split]).qrels_iter()
        return pd.DataFrame([(str(r.query_id), str(r.doc_id), int(r.relevance)) for r in qrels], columns=_QRELS)

    def corpus_iter(self) -> Iterator[dict[str, str]]:
        for doc in ir_datasets.load(self._docs_id).docs_iter():
            yield {"docno": str(doc.doc_id), "text": doc_text(getattr(doc, "title", ""), getattr(doc, "text", ""))}

    def doc_texts(self, docnos: Iterable[str]) -> dict[str, str]:
        want = list(dict.fromkeys(docnos))
        docs = ir_datasets.load(self._docs_id).docs_store().get_many(want)
        return {k: doc_text(getattr(docs[k], "title", ""), getattr(docs[k], "text", "")) for k in want if k in docs}

    @cached_property
    def num_docs(self) -> int:
        return int(ir_datasets.load(self._docs_id).docs_count())


def _judged(ds) -> bool:
    return ds.has_queries() and ds.has_qrels()


# --- local folders ----------------------------------------------------------------------------------------------


def _lines(path: Path) -> Iterator[tuple[int, str]]:
    """``(line number, line)`` of the non-blank lines of a text file."""
    with open(path, encoding="utf8") as f:
        yield from ((n, line) for n, line in enumerate(f, 1) if line.strip())


def _tsv_rows(path: Path) -> Iterator[tuple[int, list[str]]]:
    """``(line number, fields)`` of the non-empty rows of a tab-separated file (no quoting)."""
    with open(path, encoding="utf8", newline="") as f:
        yield from ((n, row) for n, row in enumerate(csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE), 1) if row)


def _read_jsonl(path: Path) -> Iterator[tuple[int, dict]]:
    for n, line in _lines(path):
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}, line {n}: not valid JSON ({e.msg})") from e
        if not isinstance(obj, dict):
            raise ValueError(f"{path}, line {n}: expected a JSON object, got {type(obj).__name__}")
        yield n, obj


def _field(obj: dict, names: tuple[str, ...], path: Path, n: int, what: str) -> str:
    for k in names:
        if k in obj and obj[k] is not None:
            return str(obj[k])
    raise ValueError(f"{path}, line {n}: no {what} field (one of {list(names)}); got keys {sorted(obj)}")


def _jsonl_corpus(path: Path) -> Iterator[dict[str, str]]:
    for n, obj in _read_jsonl(path):
        docno = _field(obj, ("_id", "docno", "doc_id", "id"), path, n, "document id")
        body = obj.get("text", obj.get("body", obj.get("contents")))
        if body is None and not obj.get("title"):
            raise ValueError(f"{path}, line {n}: document {docno!r} has no text (nor title)")
        yield {"docno": docno, "text": doc_text(obj.get("title"), body)}


def _tsv_corpus(path: Path) -> Iterator[dict[str, str]]:
    for n, row in _tsv_rows(path):
        if n == 1 and row[0].lower() in ("docno", "doc_id", "id", "_id"):
            continue
        if len(row) < 2:
            raise ValueError(f"{path}, line {n}: expected docno<TAB>text, got {len(row)} field")
        yield {"docno": row[0], "text": doc_text(row[2] if len(row) > 2 else None, row[1])}


class BeirCollection(Collection):
    """A folder in BEIR layout (module docstring)."""

    def __init__(self, folder: str | os.PathLike) -> None:
        self.folder = Path(folder)
        self.name = str(self.folder)
        for f in ("corpus.jsonl", "queries.jsonl"):
            if not (self.folder / f).is_file():
                raise ValueError(f"{self.folder} is not a BEIR folder: {f} is missing")
        if not (qrels := sorted((self.folder / "qrels").glob("*.tsv"))):
            raise ValueError(f"{self.folder} is not a BEIR folder: no qrels/<split>.tsv")
        self._qrels_files = {p.stem: p for p in qrels}
        self.splits = tuple(self._qrels_files)

    @cached_property
    def _queries(self) -> dict[str, str]:
        path = self.folder / "queries.jsonl"
        out = {}
        for n, obj in _read_jsonl(path):
            qid = _field(obj, ("_id", "qid", "query_id", "id"), path, n, "query id")
            out[qid] = _field(obj, ("text", "query"), path, n, "query text")
        return out

    def _qrels(self, split: str) -> pd.DataFrame:
        path = self._qrels_files[split]
        rows = []
        for n, row in _tsv_rows(path):
            if n == 1 and not _is_int(row[-1]):
                continue  # the header (query-id corpus-id score)
            if len(row) not in (3, 4) or not _is_int(row[-1]):
                raise ValueError(f"{path}, line {n}: expected query-id<TAB>corpus-id<TAB>score, got {row}")
            rows.append((row[0], row[-2], int(row[-1])))
        return pd.DataFrame(rows, columns=_QRELS)

    def _topics(self, split: str) -> pd.DataFrame:
        qids = list(dict.fromkeys(self.qrels(split)["qid"]))
        if missing := [q for q in qids if q not in self._queries]:
            raise ValueError(
                f"{self._qrels_files[split]} judges {len(missing)} queries missing from queries.jsonl, "
                f"e.g. {missing[:3]}"
            )
        return pd.DataFrame({"qid": qids, "query": [self._queries[q] for q in qids]})

    def corpus_iter(self) -> Iterator[dict[str, str]]:
        return _jsonl_corpus(self.folder / "corpus.jsonl")


def _is_int(s: str) -> bool:
    return bool(re.fullmatch(r"-?\d+", s.strip()))


def _split_of(name: str, keys: tuple[str, ...]) -> str | None:
    """``topics.train.txt`` -> ``train``; ``qrels`` -> ``""``; None when no key is in the name."""
    lower = name.lower()
    if not any(key in lower for key in keys):
        return None
    for ext in (".gz", ".txt", ".tsv", ".xml", ".trec", ".qrels", ".topics", ".queries"):
        lower = lower.removesuffix(ext)
    for key in keys:
        lower = lower.replace(key, " ")
    return "-".join(re.sub(r"[._\-]+", " ", lower).split())


class TrecCollection(Collection):
    """A folder of TREC-style topics, qrels and a jsonl / tsv corpus (module docstring)."""

    def __init__(self, folder: str | os.PathLike) -> None:
        self.folder = Path(folder)
        self.name = str(self.folder)
        topics, qrels, corpus = {}, {}, []
        for p in sorted(self.folder.iterdir()):
            if not p.is_file() or p.name.startswith("."):
                continue
            if (s := _split_of(p.name, ("qrels",))) is not None:
                qrels[s or "test"] = p
            elif (s := _split_of(p.name, ("topics", "queries"))) is not None:
                topics[s or "test"] = p
            elif p.suffix in (".jsonl", ".tsv"):
                corpus.append(p)
        if not corpus:
            raise ValueError(f"{self.folder}: no corpus (a .jsonl or .tsv file other than topics and qrels)")
        if len(corpus) > 1:
            raise ValueError(f"{self.folder}: more than one corpus file: {[c.name for c in corpus]}")
        self._corpus = corpus[0]
        splits = sorted(set(topics) & set(qrels))
        if not splits:
            raise ValueError(
                f"{self.folder}: no split has both a topics file (name containing 'topics' or 'queries') and a "
                f"qrels file (name containing 'qrels'); found topics {sorted(topics)} and qrels {sorted(qrels)}"
            )
        for s in sorted(set(topics) ^ set(qrels)):
            raise ValueError(
                f"{self.folder}: split {s!r} has a {'topics' if s in topics else 'qrels'} file but no "
                f"{'qrels' if s in topics else 'topics'} file"
            )
        self._topic_files, self._qrels_files = topics, qrels
        self.splits = tuple(splits)

    def _topics(self, split: str) -> pd.DataFrame:
        path = self._topic_files[split]
        head = path.read_text(encoding="utf8", errors="replace")[:4096].lower()
        if "<top" in head:  # <top>: TREC's SGML topics, <topic ...>: TREC XML
            t = pt.io.read_topics(str(path), format="trec" if "<top>" in head else "trecxml")
        else:
            rows = []
            for n, line in _lines(path):
                qid, sep, query = line.rstrip("\n").partition("\t")
                if not sep:
                    qid, sep, query = line.strip().partition(" ")
                if not sep or not query.strip():
                    raise ValueError(f"{path}, line {n}: expected qid<TAB>query, got {line.strip()[:80]!r}")
                rows.append((qid.strip(), query.strip()))
            t = pd.DataFrame(rows, columns=_TOPICS)
        t = t[["qid", "query"]].astype(str)
        if dup := t["qid"][t["qid"].duplicated()].tolist():
            raise ValueError(f"{path}: query ids repeated, e.g. {dup[:3]}")
        return t

    def _qrels(self, split: str) -> pd.DataFrame:
        path = self._qrels_files[split]
        rows = []
        for n, line in _lines(path):
            parts = line.split()
            if len(parts) != 4 or not _is_int(parts[3]):
                raise ValueError(f"{path}, line {n}: expected 'qid iter docno label', got {line.strip()[:80]!r}")
            rows.append((parts[0], parts[2], int(parts[3])))
        return pd.DataFrame(rows, columns=_QRELS)

    def corpus_iter(self) -> Iterator[dict[str, str]]:
        return _jsonl_corpus(self._corpus) if self._corpus.suffix == ".jsonl" else _tsv_corpus(self._corpus)


def load_collection(spec: str | os.PathLike | Collection) -> Collection:
    """A :class:`Collection` from an ir_datasets id, a BEIR folder or a TREC folder (module docstring)."""
    if isinstance(spec, Collection):
        return spec
    path = Path(spec)
    if path.is_dir():
        if (path / "corpus.jsonl").is_file() and (path / "queries.jsonl").is_file():
            return BeirCollection(path)
        return TrecCollection(path)
    if str(spec).startswith("irds:") or not path.exists():
        return IrdsCollection(str(spec))
    raise ValueError(f"{spec!r} is neither an ir_datasets id nor a folder (BEIR or TREC layout)")


# --- splits of an experiment ------------------------------------------------------------------------------------


def split_topics(topics: pd.DataFrame, seed: int = 0, fraction: float = 0.5) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Split a topics frame into two disjoint seeded parts ``(calibration, evaluation)``, input order kept; the first
    has ``round(fraction * n)`` queries (at least 1, leaving at least 1). For collections without a dev split."""
    n = len(topics)
    if n < 2:
        raise ValueError(f"need at least 2 queries to split into calibration and evaluation halves, got {n}")
    k = min(n - 1, max(1, round(fraction * n)))
    chosen = set(random.Random(seed).sample(range(n), k))
    mask = [i in chosen for i in range(n)]
    return topics[mask].reset_index(drop=True), topics[[not m for m in mask]].reset_index(drop=True)


class HeldOutCollection(Collection):
    """``base`` with split ``source`` divided by a seeded draw into ``<source>-fit`` and a held-out ``<source>-dev``
    (``fraction`` of its queries, :func:`split_topics`): for a collection with train and no dev split. The other splits,
    the corpus and ``name`` (so shared indexes) are ``base``'s."""

    def __init__(self, base: Collection, source: str = "train", fraction: float = 0.25, seed: int = 0) -> None:
        finite_float(
            f"fraction (the held-out share of {source!r})", fraction, low=0, high=1, low_open=True, high_open=True
        )
        topics = base.topics(source)
        if len(topics) < 2:
            raise ValueError(f"{base.name}/{source} has {len(topics)} query: too few to hold out a dev part")
        dev, fit = split_topics(topics, seed=seed, fraction=fraction)
        self.base, self.name, self.source = base, base.name, source
        self.fit_split, self.dev_split = f"{source}-fit", f"{source}-dev"
        if taken := {self.fit_split, self.dev_split} & set(base.splits):
            raise ValueError(f"{base.name} already has a split named {sorted(taken)[0]!r}")
        self._qids = {self.fit_split: set(fit["qid"]), self.dev_split: set(dev["qid"])}
        self.splits = tuple(s for s in base.splits if s != source) + (self.fit_split, self.dev_split)

    def _part(self, split: str, read: Callable[[str], pd.DataFrame]) -> pd.DataFrame:
        """``read(split)`` of ``base``, or for the fit / dev part the rows of ``source`` with the part's queries."""
        if split not in self._qids:
            return read(split)
        frame = read(self.source)
        return frame[frame["qid"].isin(self._qids[split])]

    def _topics(self, split: str) -> pd.DataFrame:
        return self._part(split, self.base.topics)

    def _qrels(self, split: str) -> pd.DataFrame:
        return self._part(split, self.base.qrels)

    def corpus_iter(self) -> Iterator[dict[str, str]]:
        return self.base.corpus_iter()

    def doc_texts(self, docnos: Iterable[str]) -> dict[str, str]:
        return self.base.doc_texts(docnos)

    @cached_property
    def num_docs(self) -> int:
        return self.base.num_docs


def _named_splits(collection: Collection, **named: str | None) -> tuple[str, ...]:
    """The collection's splits, after checking that every split named explicitly (``--<role>-split``) is one."""
    for role, value in named.items():
        if value is not None and value not in collection.splits:
            raise ValueError(f"--{role}-split {value!r}: {collection.name} has splits {list(collection.splits)}")
    return collection.splits


@dataclass
class SplitChoice:
    """Which splits an experiment trains on, calibrates on and reports on (see :func:`choose_splits`)."""

    train: str | None
    dev: str | None
    test: str
    note: str


def choose_splits(
    collection: Collection, train: str | None = None, dev: str | None = None, test: str | None = None
) -> SplitChoice:
    """Pick train / dev / test among the collection's splits; explicit names win. ``test``: ``test``, else the only
    split; ``train``: ``train`` if present; ``dev``: the first of dev/validation/valid/val present (each else None)."""
    s = _named_splits(collection, train=train, dev=dev, test=test)
    if test is None:
        test = "test" if "test" in s else s[0] if len(s) == 1 else None
        if test is None:
            raise ValueError(f"{collection.name} has no 'test' split; name one with --test-split (splits: {list(s)})")
    if train is None and "train" in s and test != "train":
        train = "train"
    if dev is None:
        dev = next((d for d in _DEV_NAMES if d in s and d != test), None)
    if test in (train, dev):
        raise ValueError(f"the test split {test!r} must differ from the train and dev splits")
    return SplitChoice(train, dev, test, f"splits of {collection.name}: train={train}, dev={dev}, test={test}")


def source_splits(
    collection: Collection, train: str | None = None, dev: str | None = None
) -> tuple[str | None, str | None]:
    """Train and dev splits of a collection used only as a training source (zero-shot transfer): explicit names
    win, else ``train`` and the first of dev/validation/valid/val that it has (each None when absent)."""
    s = _named_splits(collection, train=train, dev=dev)
    train = train or ("train" if "train" in s else None)
    dev = dev or next((d for d in _DEV_NAMES if d in s), None)
    if train is not None and train == dev:
        raise ValueError(f"the train and dev splits must differ, got {train!r} for both")
    return train, dev


def write_beir_sample(
    folder: str | os.PathLike,
    splits: dict[str, int],
    *,
    source: str = "beir/nfcorpus",
    docs_per_query: int = 6,
    extra_docs: int = 60,
    seed: int = 0,
) -> dict[str, object]:
    """Write a small BEIR folder (``corpus.jsonl``, ``queries.jsonl``, ``qrels/<split>.tsv``) cut from the ir_datasets
    BEIR collection ``source``: per split the first ``n`` queries (by qid) with judged-relevant documents, the i-th
    with up to ``1 + i % docs_per_query`` of them (so the number of relevant documents varies), plus ``extra_docs``
    other documents drawn with ``seed``. For tests and benchmarks that need a local collection folder.

    Returns ``{"docs": n_docs, "queries": {split: n}, "qrels": {split: n_rows}}``, what loading the folder must give."""
    if docs_per_query < 1 or extra_docs < 0:
        raise ValueError(f"write_beir_sample: docs_per_query must be >= 1 and extra_docs >= 0, got "
                         f"{docs_per_query} and {extra_docs}")  # fmt: skip
    folder = Path(folder)
    (folder / "qrels").mkdir(parents=True, exist_ok=True)
    base = ir_datasets.load(source)
    queries: dict[str, str] = {}
    counts: dict[str, int] = {}
    rows_by_split: dict[str, list[tuple[str, str]]] = {}
    wanted: set[str] = set()
    for split, n in splits.items():
        ds = ir_datasets.load(f"{source}/{split}")
        texts = {q.query_id: q.text for q in ds.queries_iter()}
        rel: dict[str, list[str]] = {}
        for r in ds.qrels_iter():
            if r.relevance >= 1 and r.query_id in texts:
                rel.setdefault(r.query_id, []).append(r.doc_id)
        chosen = sorted(rel)[:n]
        rows = [(q, d) for i, q in enumerate(chosen) for d in sorted(rel[q])[: 1 + i % docs_per_query]]
        rows_by_split[split] = rows
        wanted |= {d for _, d in rows}
        queries.update({q: texts[q] for q in chosen})
        counts[split] = len(chosen)
    others = [d.doc_id for d in base.docs_iter() if d.doc_id not in wanted]
    wanted |= set(random.Random(seed).sample(others, extra_docs))
    store = base.docs_store()
    with open(folder / "corpus.jsonl", "w", encoding="utf8") as f:
        for doc_id in sorted(wanted):
            d = store.get(doc_id)
            f.write(json.dumps({"_id": doc_id, "title": d.title, "text": d.text}) + "\n")
    with open(folder / "queries.jsonl", "w", encoding="utf8") as f:
        for qid, text in queries.items():
            f.write(json.dumps({"_id": qid, "text": text}) + "\n")
    for split, rows in rows_by_split.items():
        lines = "".join(f"{q}\t{d}\t1\n" for q, d in rows)
        (folder / "qrels" / f"{split}.tsv").write_text("query-id\tcorpus-id\tscore\n" + lines, encoding="utf8")
    return {"docs": len(wanted), "queries": counts, "qrels": {s: len(r) for s, r in rows_by_split.items()}}
