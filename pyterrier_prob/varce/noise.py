"""Query-noise injection: the six one-word perturbations of VarCrossEncoder Sec. 4.5.2 (Table 4), e.g.
``QueryNoise("SR", seed=1) >> bm25 % 100 >> text >> reranker`` (the original query kept in ``query_0``). The resources
are offline: NLPaug's misspelling dictionary (SE), a model's input token embeddings (WEI, WES) and WordNet (SR,
optional: :func:`wordnet_available`); docs/varce.md ("Query perturbations") says how words are picked."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import warnings
from collections.abc import Iterable
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyterrier as pt
import torch

from pyterrier_prob.dense import validate_columns
from st_extensions import default_model_path, load_model
from st_extensions.checks import choice, non_negative_int, positive_int

__all__ = [
    "NOISE_DESCRIPTIONS",
    "NOISE_TYPES",
    "EmbeddingNeighbours",
    "QueryNoise",
    "WordNet",
    "all_noise",
    "build_noises",
    "find_wordnet",
    "spelling_dictionary",
    "wordnet_available",
]

NOISE_TYPES: tuple[str, ...] = (
    "spelling", "wordemb_insert", "wordemb_substitute", "synonym", "random_swap", "random_delete"
)  # fmt: skip
"""The six perturbations of Sec. 4.5.2, in the paper's order."""

ABBREVIATIONS: dict[str, str] = {
    "RD": "random_delete",
    "RS": "random_swap",
    "SE": "spelling",
    "SR": "synonym",
    "WEI": "wordemb_insert",
    "WES": "wordemb_substitute",
    "SP": "spelling",
}
"""The paper's abbreviations (Table 4; the text also writes SP for spelling)."""

NOISE_DESCRIPTIONS: dict[str, str] = {
    "RD": "(random deletion): a word is removed",
    "RS": "(random swap): two words exchange positions",
    "SE": "(spelling error): a word becomes one of its common misspellings",
    "SR": "(synonym replacement): a word is replaced by a WordNet synonym",
    "WEI": "(word-embedding insertion): a word's embedding neighbour is inserted after it",
    "WES": "(word-embedding substitution): a word is replaced by one of its embedding neighbours",
}
"""What each perturbation of Table 4 changes (one word per query), for reports."""

_NO_WORDNET = ("RD", "RS", "SE", "WEI", "WES")  # the perturbations that do not need WordNet

STOPWORDS: frozenset[str] = frozenset(
    """a an and are as at be by for from has have how i in is it its of on or that the this to was what when
    where which who why will with do does did can could should would my your their our there these those
    not no""".split()
)
"""Words picked only when a query has no other candidate."""

WORDNET_DIRS: tuple[str, ...] = (
    "/usr/share/wordnet",
    "/usr/share/nltk_data/corpora/wordnet",
    "/usr/local/share/nltk_data/corpora/wordnet",
    "/usr/lib/nltk_data/corpora/wordnet",
    "~/nltk_data/corpora/wordnet",
)
"""Where :func:`find_wordnet` looks after ``wordnet_dir`` and ``$WORDNET_DIR``."""

WORDNET_INSTALL = (
    "install it with 'apt-get install wordnet-base' (Debian/Ubuntu, files in /usr/share/wordnet), or point "
    "wordnet_dir= or $WORDNET_DIR at a WordNet 3.x dict directory (e.g. an unpacked NLTK corpora/wordnet)"
)
"""How to get WordNet, for the error messages."""

_SR_SKIPPED = f"robustness: SR (WordNet synonym replacement) skipped: WordNet is missing; {WORDNET_INSTALL}"
_WORD = re.compile(r"^(\W*)(.*?)(\W*)$", re.UNICODE)
_ALPHA = re.compile(r"[A-Za-z]")


def _canonical_type(kind: str) -> str:
    key = str(kind).strip()
    if key.upper() in ABBREVIATIONS:
        return ABBREVIATIONS[key.upper()]
    key = key.lower().replace("-", "_").replace(" ", "_")
    if key not in NOISE_TYPES:
        raise ValueError(f"noise type must be one of {NOISE_TYPES} or {sorted(ABBREVIATIONS)}, got {kind!r}")
    return key


def _nlpaug_spelling_file() -> Path:
    spec = importlib.util.find_spec("nlpaug")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(
            "the spelling perturbation reads NLPaug's misspelling dictionary: pip install nlpaug "
            "(or pass spelling_path= a file of 'word misspelling1 misspelling2 ...' lines)"
        )
    return Path(list(spec.submodule_search_locations)[0]) / "res" / "word" / "spelling" / "spelling_en.txt"


@lru_cache(maxsize=4)
def spelling_dictionary(path: str | None = None) -> dict[str, tuple[str, ...]]:
    """``{word: misspellings}`` from a file of ``word misspelling1 misspelling2 ...`` lines (default: NLPaug's). Only
    the forward direction (correct word -> its misspellings): queries are assumed spelled correctly."""
    file = Path(path) if path is not None else _nlpaug_spelling_file()
    if not file.is_file():
        raise FileNotFoundError(f"no misspelling dictionary at {str(file)!r}")
    out: dict[str, set[str]] = {}
    with open(file, encoding="utf-8") as f:
        for word, *misspellings in (line.split() for line in f if not line.isspace()):
            key = word.lower()
            out.setdefault(key, set()).update(p for p in misspellings if p.lower() != key)
    return {k: tuple(sorted(v)) for k, v in out.items() if v}


def _wordnet_search_path() -> list[str]:
    """``$WORDNET_DIR``, then :data:`WORDNET_DIRS` (tests replace this to simulate a machine without WordNet)."""
    env = os.environ.get("WORDNET_DIR")
    return [*([env] if env else []), *WORDNET_DIRS]


def find_wordnet(wordnet_dir: str | os.PathLike | None = None) -> Path:
    """The directory of the Princeton WordNet database files, or a ``FileNotFoundError`` saying how to get them."""
    candidates = [wordnet_dir] if wordnet_dir is not None else _wordnet_search_path()
    for p in (Path(c).expanduser() for c in candidates):
        if (p / "index.noun").is_file() and (p / "data.noun").is_file():
            return p
        if (p / "dict" / "index.noun").is_file():
            return p / "dict"
    where = ", ".join(str(c) for c in candidates) or "(no directory to search)"
    raise FileNotFoundError(
        f"WordNet is missing: no WordNet database (index.noun, data.noun, ...) in {where}; {WORDNET_INSTALL}"
    )


def wordnet_available(wordnet_dir: str | os.PathLike | None = None) -> bool:
    """Whether :func:`find_wordnet` finds a WordNet database (what the ``synonym`` perturbation needs)."""
    try:
        find_wordnet(wordnet_dir)
    except FileNotFoundError:
        return False
    return True


_POS = ("noun", "verb", "adj", "adv")
# fmt: off
_SUBSTITUTIONS: dict[str, tuple[tuple[str, str], ...]] = {  # WordNet's morphy suffix rules
    "noun": (("s", ""), ("ses", "s"), ("ves", "f"), ("xes", "x"), ("zes", "z"), ("ches", "ch"), ("shes", "sh"),
             ("men", "man"), ("ies", "y")),
    "verb": (("s", ""), ("ies", "y"), ("es", "e"), ("es", ""), ("ed", "e"), ("ed", ""), ("ing", "e"), ("ing", "")),
    "adj": (("er", ""), ("est", ""), ("er", "e"), ("est", "e")),
    "adv": (),
}
# fmt: on


def _split_lines(path: Path) -> list[list[str]]:
    """The words of each line of a WordNet file, without the licence header (lines starting with a space)."""
    with open(path, encoding="utf-8", errors="replace") as f:
        return [line.split() for line in f if not line.startswith(" ")]


class WordNet:
    """A minimal reader of the Princeton WordNet database files (``index.<pos>``, ``data.<pos>``, ``<pos>.exc`` for pos
    in noun, verb, adj, adv): lemmas -> synsets (by byte offset) -> synonyms."""

    def __init__(self, root: str | os.PathLike | None = None) -> None:
        self.root = find_wordnet(root)
        self._index: dict[str, dict[str, tuple[int, ...]]] = {}
        self._exc: dict[str, dict[str, tuple[str, ...]]] = {}
        self._data: dict[str, bytes] = {}
        for pos in _POS:  # an index line: lemma pos synset_cnt ... offset_1 ... offset_<synset_cnt>
            rows = _split_lines(self.root / f"index.{pos}")
            self._index[pos] = {p[0]: tuple(int(o) for o in p[-int(p[2]) :]) for p in rows if len(p) >= 6}
            exc = self.root / f"{pos}.exc"
            self._exc[pos] = {p[0]: tuple(p[1:]) for p in (_split_lines(exc) if exc.is_file() else []) if len(p) >= 2}

    def __repr__(self) -> str:
        return f"WordNet({str(self.root)!r})"

    def lemmas(self, word: str, pos: str) -> list[str]:
        """Base forms of ``word`` in ``pos`` that WordNet knows (morphy: the word, its exceptions, suffix rules)."""
        w = word.lower().replace(" ", "_")
        forms = [w, *self._exc[pos].get(w, ())]
        forms += [w[: -len(old)] + new for old, new in _SUBSTITUTIONS[pos] if w.endswith(old) and len(w) > len(old)]
        return list(dict.fromkeys(f for f in forms if f in self._index[pos]))

    def _synset_words(self, pos: str, offset: int) -> list[str]:
        if pos not in self._data:
            self._data[pos] = (self.root / f"data.{pos}").read_bytes()
        data = self._data[pos]
        end = data.find(b"\n", offset)
        parts = data[offset : end if end >= 0 else None].decode("utf-8", errors="replace").split()
        return [re.sub(r"\(.*\)$", "", w) for w in parts[4 : 4 + 2 * int(parts[3], 16) : 2]]  # w_cnt is hex

    def synonyms(self, word: str, multiword: bool = False) -> list[str]:
        """WordNet synonyms of ``word`` (every sense, every part of speech), without the word and its base forms.
        Multi-word lemmas (``"heart_attack"``) are left out unless ``multiword`` (then with spaces)."""
        exclude, found = {word.lower()}, []
        for pos in _POS:
            lemmas = self.lemmas(word, pos)
            exclude.update(lemmas)
            found += [w for lemma in lemmas for o in self._index[pos][lemma] for w in self._synset_words(pos, o)]
        out = dict.fromkeys(w.replace("_", " ") for w in found if multiword or not ("_" in w or "-" in w))
        return [w for w in out if w.lower().replace(" ", "_") not in exclude]


_wordnet = lru_cache(maxsize=2)(WordNet)  # the reader of a WordNet directory find_wordnet found, read once


class EmbeddingNeighbours:
    """The ``top_k`` nearest whole-word tokens of a word in the input token-embedding space (cosine) of ``model``: a
    sentence-transformers model or CrossEncoder with a Hugging Face encoder, its path, or None (all-MiniLM-L6-v2)."""

    def __init__(self, model: Any = None, top_k: int = 10) -> None:
        self.top_k = positive_int("top_k", top_k)
        if model is None or isinstance(model, (str, os.PathLike)):
            model = load_model(os.fspath(model) if model is not None else default_model_path(), device="cpu")
        auto_model = getattr(model[0], "auto_model", None) if hasattr(model, "__getitem__") else None
        tokenizer = getattr(model, "tokenizer", None)
        if auto_model is None or tokenizer is None:
            raise ValueError("EmbeddingNeighbours needs a model whose first module holds a Hugging Face encoder")
        self.tokenizer = tokenizer
        weight = auto_model.get_input_embeddings().weight.detach().float().cpu()
        words = sorted((t, i) for t, i in tokenizer.get_vocab().items() if re.fullmatch(r"[a-z]{2,}", t))
        self.words = [t for t, _ in words]
        self._row = {t: r for r, t in enumerate(self.words)}
        self._candidates = torch.nn.functional.normalize(weight[[i for _, i in words]], dim=-1).numpy()

    def __contains__(self, word: str) -> bool:
        """Whether ``word`` (lower-cased) is a whole-word token of the vocabulary, i.e. has an embedding."""
        return word.lower() in self._row

    def neighbours(self, word: str, k: int | None = None) -> list[str]:
        """The ``k`` (default ``top_k``) nearest whole-word tokens of ``word``, nearest first, without the word;
        ``[]`` for a word outside the vocabulary (as word-embedding augmenters skip out-of-vocabulary words)."""
        k = self.top_k if k is None else k
        row = self._row.get(word.lower())
        if row is None:
            return []
        top = np.argsort(-(self._candidates @ self._candidates[row]), kind="stable")[: k + 1]  # by cosine
        return [self.words[i] for i in top if i != row][:k]


@lru_cache(maxsize=2)
def _default_neighbours(top_k: int) -> EmbeddingNeighbours:
    return EmbeddingNeighbours(None, top_k=top_k)


def _core(token: str) -> str:
    """The word of a token, without its leading and trailing punctuation."""
    return _WORD.match(token).group(2)


def _recased(token: str, new: str) -> str:
    """``token`` with its word replaced by ``new``: punctuation kept, capitalised if the word was."""
    prefix, core, suffix = _WORD.match(token).groups()
    if core[:1].isupper() and new[:1].islower():
        new = new[:1].upper() + new[1:]
    return f"{prefix}{new}{suffix}"


def _typo(word: str, rng: np.random.Generator) -> str | None:
    """Swap two adjacent inner letters (first and last letter kept) so the word changes; None if impossible."""
    positions = [i for i in range(1, len(word) - 2) if word[i] != word[i + 1]]
    if not positions:
        return None
    i = positions[int(rng.integers(len(positions)))]
    return word[:i] + word[i + 1] + word[i] + word[i + 2 :]


class QueryNoise(pt.Transformer):
    """Perturbs one word of every query (Sec. 4.5.2); ``query_0`` keeps the original (as
    :func:`pyterrier.model.push_queries`). ``kind``: one of :data:`NOISE_TYPES` or the paper's abbreviation; ``seed``
    with the qid and query seeds each query. WEI/WES draw among the ``top_k`` neighbours in ``embedding_model`` (a
    model, its path or an :class:`EmbeddingNeighbours`; default all-MiniLM-L6-v2); SR reads ``wordnet_dir``; SE reads
    ``spelling_path`` (default NLPaug's), with ``spelling_fallback`` swapping two inner letters when no word has a
    misspelling. ``stopwords`` are picked only when no other word can be."""

    def __init__(
        self,
        kind: str,
        seed: int = 0,
        *,
        embedding_model: Any = None,
        top_k: int = 10,
        wordnet_dir: str | os.PathLike | None = None,
        spelling_path: str | os.PathLike | None = None,
        spelling_fallback: bool = True,
        stopwords: Iterable[str] | None = STOPWORDS,
    ) -> None:
        self.kind = _canonical_type(kind)
        self.seed = non_negative_int("seed", seed)
        self.top_k = positive_int("top_k", top_k)
        self.stopwords = frozenset(w.lower() for w in stopwords) if stopwords is not None else frozenset()
        self.spelling_fallback = bool(spelling_fallback)
        # load the resource now, so a missing one fails at construction rather than mid-pipeline
        self._resource: Any = None
        if self.kind == "spelling":
            self._resource = spelling_dictionary(None if spelling_path is None else os.fspath(spelling_path))
        elif self.kind in ("wordemb_insert", "wordemb_substitute"):
            if isinstance(embedding_model, EmbeddingNeighbours):
                self._resource = embedding_model
            elif embedding_model is None:
                self._resource = _default_neighbours(top_k)
            else:
                self._resource = EmbeddingNeighbours(embedding_model, top_k=top_k)
        elif self.kind == "synonym":
            try:  # looked up on every construction (the reader is cached per directory)
                root = find_wordnet(wordnet_dir)
            except FileNotFoundError as e:
                raise FileNotFoundError(
                    f"QueryNoise({kind!r}): the synonym perturbation (SR) replaces words by WordNet synonyms and "
                    f"needs the WordNet database. {e}. The other perturbations ({', '.join(_NO_WORDNET)}) work "
                    "without it."
                ) from None
            self._resource = _wordnet(str(root))

    def __repr__(self) -> str:
        return f"QueryNoise({self.kind!r}, seed={self.seed})"

    def subtransformers(self) -> dict:
        return {}

    def rng(self, qid: str, query: str) -> np.random.Generator:
        """The generator of one query: a function of (seed, type, qid, query) only."""
        digest = hashlib.sha256(f"{self.kind}\x00{qid}\x00{query}".encode()).digest()
        return np.random.default_rng([self.seed, *np.frombuffer(digest[:16], dtype=np.uint32).tolist()])

    def _pick(self, tokens: list[str], rng: np.random.Generator, ok: Any) -> list[int]:
        """Candidate positions in random order: content words first, stopwords after."""
        cores = [_core(t) for t in tokens]
        order = sorted(rng.permutation(len(tokens)).tolist(), key=lambda i: cores[i].lower() in self.stopwords)
        return [i for i in order if _ALPHA.search(cores[i]) and ok(cores[i])]

    def perturb(self, query: str, qid: str = "") -> str:
        """The perturbed query (the query itself when the perturbation cannot apply to it)."""
        tokens = str(query).split()
        rng = self.rng(str(qid), str(query))
        if not tokens:
            return str(query)
        if self.kind == "random_delete":
            if len(tokens) < 2:
                return str(query)
            i = (self._pick(tokens, rng, lambda w: True) or rng.permutation(len(tokens)).tolist())[0]
            return " ".join(tokens[:i] + tokens[i + 1 :])
        if self.kind == "random_swap":
            pairs = [(i, j) for i in range(len(tokens)) for j in range(i + 1, len(tokens)) if tokens[i] != tokens[j]]
            if not pairs:
                return str(query)
            i, j = pairs[int(rng.integers(len(pairs)))]
            tokens[i], tokens[j] = tokens[j], tokens[i]
            return " ".join(tokens)
        for i in self._pick(tokens, rng, self._has_options):
            options = self._options(_core(tokens[i]))
            if not options:
                continue
            new = options[int(rng.integers(len(options)))]
            new = f"{tokens[i]} {new}" if self.kind == "wordemb_insert" else _recased(tokens[i], new)  # WEI: after it
            return self._replace(tokens, i, new)
        if self.kind == "spelling" and self.spelling_fallback:
            for i in self._pick(tokens, rng, lambda w: len(w) >= 4):
                typo = _typo(_core(tokens[i]), rng)
                if typo is not None:
                    return self._replace(tokens, i, _recased(tokens[i], typo))
        return str(query)

    def _has_options(self, word: str) -> bool:
        """Whether ``word`` may be picked: in the misspelling dictionary (SE) or the vocabulary (WEI/WES)."""
        return self.kind == "synonym" or word.lower() in self._resource

    def _options(self, word: str) -> list[str] | tuple[str, ...]:
        """The words that may replace (or, for WEI, follow) ``word``."""
        if self.kind == "spelling":
            return self._resource[word.lower()]
        if self.kind == "synonym":
            return self._resource.synonyms(word)
        return self._resource.neighbours(word, self.top_k)

    @staticmethod
    def _replace(tokens: list[str], i: int, new: str) -> str:
        return " ".join(tokens[:i] + [new] + tokens[i + 1 :])

    def transform(self, inp: pd.DataFrame) -> pd.DataFrame:
        hint = "apply it to topics (a query frame, no docno) before retrieval, e.g. QueryNoise('SR') >> bm25"
        validate_columns(self, inp, ["query"], hint, rerank=False)
        out = pt.model.push_queries(inp.reset_index(drop=True))
        out["query"] = [self.perturb(q, qid) for qid, q in zip(out["qid"].astype(str), out["query_0"])]
        return out


def all_noise(seed: int = 0, *, missing: str = "raise", **kwargs: Any) -> dict[str, QueryNoise]:
    """``{abbreviation: QueryNoise}`` for the six perturbations of Table 4 (RD, RS, SE, SR, WEI, WES), ``kwargs``
    passed to each. A missing resource (WordNet for SR): ``missing="raise"`` its error (saying how to install it),
    ``"warn"`` leave the perturbation out with a ``UserWarning``, ``"skip"`` leave it out silently."""
    choice("missing", missing, ("raise", "warn", "skip"))
    out: dict[str, QueryNoise] = {}
    for abbr in NOISE_DESCRIPTIONS:  # Table 4's abbreviations (not SP, the text's other name for SE)
        try:
            out[abbr] = QueryNoise(abbr, seed, **kwargs)
        except (FileNotFoundError, ImportError) as e:
            if missing == "raise":
                raise
            if missing == "warn":
                warnings.warn(f"all_noise: {abbr} left out: {e}", UserWarning, stacklevel=2)
    return out


def build_noises(kinds: Iterable[str], seed: int) -> tuple[dict[str, QueryNoise], list[str]]:
    """The robustness table's perturbations (abbreviations, in the order of :data:`NOISE_DESCRIPTIONS`) and a note per
    perturbation left out because its resource is missing -- SR without WordNet -- instead of failing the run."""
    noises: dict[str, QueryNoise] = {}
    notes: list[str] = []
    for abbr in (k for k in NOISE_DESCRIPTIONS if k in set(kinds)):
        try:
            noises[abbr] = QueryNoise(abbr, seed)
        except (OSError, ImportError) as e:  # WordNet, or NLPaug's misspelling dictionary, is missing
            notes.append(
                _SR_SKIPPED if abbr == "SR" and not wordnet_available() else f"robustness: {abbr} skipped: {e}"
            )
    return noises, notes
