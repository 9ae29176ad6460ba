"""Pseudo-queries cut from a collection's own documents, to train re-rankers on more queries than the judged ones
(GPL's recipe, Wang et al., NAACL 2022, with spans in place of a generative model, which is not available offline):
a document's title, or a random span of its body (Contriever's cropping, Izacard et al., TMLR 2022; the inverse cloze
task, Lee et al., ACL 2019). A pseudo-query never meets the document it was cut from: :func:`drop_sources` leaves that
document out of its candidate pool, so no training pair holds the very text it was cut from. Plain frames in and out.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import numpy as np
import pandas as pd

__all__ = ["KINDS", "drop_sources", "pseudo_queries"]

#: What a pseudo-query is cut from: the document's title (its first line), or a span of words of its body.
KINDS = ("title", "span")


def _title_and_body(text: str) -> tuple[str, str]:
    """A document's title (its first line, when it has more than one) and body (the rest, or the whole text)."""
    head, sep, rest = text.strip().partition("\n")
    return (head.strip(), rest.strip()) if sep and rest.strip() else ("", text.strip())


def pseudo_queries(
    corpus: Mapping[str, str],
    kinds: Sequence[str] = KINDS,
    *,
    span_words: tuple[int, int] = (3, 10),
    min_title_words: int = 2,
    seed: int = 0,
    exclude: Iterable[str] = (),
) -> pd.DataFrame:
    """One pseudo-query per document and kind: ``qid`` (``pq-<kind>-<docno>``), ``query``, ``source`` (the docno it
    was cut from) and ``kind``. ``title``: the document's first line when it has a body after it (at least
    ``min_title_words`` words); ``span``: ``n`` consecutive words of the body, ``n`` uniform in ``span_words``
    (inclusive), at a uniform start (documents shorter than twice the longest span give none). Texts equal to one of
    ``exclude`` (e.g. the dev and test queries; compared case-insensitively) and repeated texts are dropped."""
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown or not kinds:
        raise ValueError(f"pseudo-query kinds: choose from {list(KINDS)}, got {list(kinds)}")
    low, high = span_words
    if not 1 <= low <= high:
        raise ValueError(f"span_words must be 1 <= low <= high, got {span_words}")
    rng = np.random.default_rng(seed)
    seen = {" ".join(str(q).lower().split()) for q in exclude}
    rows = []
    for docno in sorted(corpus):
        title, body = _title_and_body(str(corpus[docno]))
        for kind in kinds:
            if kind == "title":
                words = title.split()
                query = " ".join(words) if len(words) >= min_title_words else ""
            else:
                words = body.split()
                n = int(rng.integers(low, high + 1))
                if len(words) < 2 * high:
                    continue
                start = int(rng.integers(0, len(words) - n + 1))
                query = " ".join(words[start : start + n])
            key = query.lower()
            if not query or key in seen:
                continue
            seen.add(key)
            rows.append({"qid": f"pq-{kind}-{docno}", "query": query, "source": str(docno), "kind": kind})
    return pd.DataFrame(rows, columns=["qid", "query", "source", "kind"])


def drop_sources(pool: pd.DataFrame, queries: pd.DataFrame) -> pd.DataFrame:
    """``pool`` (``qid, docno, ...``) without the rows that pair a pseudo-query with the document it was cut from
    (``queries``: :func:`pseudo_queries`' frame)."""
    source = pool["qid"].map(dict(zip(queries["qid"], queries["source"])))
    return pool[source.isna() | (source != pool["docno"].astype(str))].reset_index(drop=True)
