"""Seconds to retrieve with pEBR's CDF cutoff vs an exhaustive top-k (faiss IndexFlatIP, pyterrier-dr).

Exact search has a floor: every query-document score has to be computed. The CDF cutoff
(:class:`~pyterrier_prob.CDFCutoffRetriever`) computes them all and keeps ``cos >= t_q`` (capped at k), so it
should cost little more than the classic exhaustive top-k. On the same synthetic, seeded DenseIndex
(default 100,000 unit vectors of dim 384, 1,000 queries), in one run, with the same number of threads for
faiss, numpy's BLAS and the cutoff's masking threads, this times, interleaved and repeated:

* ``faiss_flat_search``: ``faiss.IndexFlatIP.search(Q, k)`` on the same vectors (``add`` not timed) -- the
  reference (target: CDF cutoff / faiss <= 1.2);
* ``cdf_cutoff``: ``CDFCutoffRetriever(index, p, family="beta", num_results=k).transform(frame)`` end to end
  (threshold from ``query_temp``, search, output frame with docnos);
* ``cdf_threshold_search``: the search core alone, ``threshold_search(index, Q, t_q, k)``;
* ``dr_np_retriever`` / ``dr_faiss_flat_retriever``: pyterrier-dr's own ``FlexIndex.np_retriever(num_results=k)``
  and ``FlexIndex.faiss_flat_retriever()`` on the same index and query frame, end to end;
* ``topk`` / ``score_cutoff``: :class:`~pyterrier_prob.TopKRetriever` and
  :class:`~pyterrier_prob.ScoreCutoffRetriever` (one threshold for all queries: the median t_q), for reference;
* ``all_scores_numpy``: the bare ``Q @ D^T`` in the cutoff's blocks, no selection -- the floor.

Data: documents are a Zipf-sized mixture of clusters, ``d = normalise(c + s_d g / sqrt(dim))`` with a spread
s_d per document, so a query's cosines to its cluster range smoothly from ~0.9 to ~0.5 and thresholds keep a
plausible, query-dependent number of documents; a query is a noisy copy of the centre of a random document's
cluster (so big clusters get more queries), with a per-query ``query_temp`` drawn from [0.03, 0.1]. The BetaNCE
threshold is ``t_q = 2 (1 - p)^tau_q - 1`` (1-D law); the kept-count statistics are printed.

faiss-cpu bundles its own OpenBLAS; where it picks older kernels than numpy's (``Prescott`` vs ``SkylakeX`` on
some virtual machines), the script re-runs itself with ``OPENBLAS_CORETYPE`` set to numpy's, so that faiss's
scoring is not handicapped (``--faiss-blas-as-is`` keeps the wheel's choice).

Correctness is checked inside the run on a few queries: the CDF kept set against float64 brute force
(``cos >= t_q``, capped at k), and faiss's top-k against :class:`~pyterrier_prob.TopKRetriever`.

    python benchmarks/cutoff_speed.py [--docs 100000 --queries 1000 --dim 384 --k 1000 --p 0.9 --repeats 3]
    python benchmarks/cutoff_speed.py --quick    # tiny sizes, a smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

import numpy as np
import pandas as pd

sys.path.insert(0, os.path.dirname(__file__))
from _machine import describe  # noqa: E402

TARGET = 1.2  # CDF cutoff / faiss IndexFlatIP top-k
EPS = 1e-5  # float32 scores vs float64 brute force: documents this close to a threshold may go either way
N_CHECK = 8  # queries checked against brute force


def unit(x: np.ndarray) -> np.ndarray:
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def make_data(n_docs: int, n_queries: int, dim: int, seed: int) -> dict:
    """Clustered unit document vectors, noisy cluster-centre queries, per-query temperatures (seeded)."""
    rng = np.random.default_rng(seed)
    n_clusters = max(2, n_docs // 100)
    centres = unit(rng.standard_normal((n_clusters, dim))).astype(np.float32)
    weights = 1.0 / np.arange(1, n_clusters + 1) ** 0.8  # Zipf-like cluster sizes: head and tail topics
    assign = rng.choice(n_clusters, n_docs, p=weights / weights.sum())
    spread = rng.uniform(0.2, 1.5, n_docs).astype(np.float32)
    docs = np.empty((n_docs, dim), np.float32)
    for i in range(0, n_docs, 16384):  # in chunks: no (n_docs, dim) float64 temporaries
        j = min(n_docs, i + 16384)
        noise = rng.standard_normal((j - i, dim), dtype=np.float32) / np.float32(np.sqrt(dim))
        docs[i:j] = unit(centres[assign[i:j]] + spread[i:j, None] * noise)
    q_cluster = assign[rng.integers(0, n_docs, n_queries)]
    q_spread = rng.uniform(0.2, 0.8, n_queries).astype(np.float32)
    noise = rng.standard_normal((n_queries, dim), dtype=np.float32) / np.float32(np.sqrt(dim))
    queries = unit(centres[q_cluster] + q_spread[:, None] * noise).astype(np.float32)
    tau = rng.uniform(0.03, 0.1, n_queries)
    return {"docs": docs, "queries": queries, "tau": tau, "clusters": n_clusters}


def set_threads(n: int | None) -> int:
    """Use n threads everywhere: CPU affinity (the cutoff's masking threads), BLAS pools, faiss's OpenMP."""
    import faiss
    from threadpoolctl import threadpool_limits

    cpus = sorted(os.sched_getaffinity(0))
    n = len(cpus) if n is None else max(1, min(n, len(cpus)))
    if n < len(cpus):
        os.sched_setaffinity(0, set(cpus[:n]))
    threadpool_limits(limits=n)
    faiss.omp_set_num_threads(n)
    return n


def fix_faiss_blas(as_is: bool) -> str | None:
    """Give faiss's bundled OpenBLAS the kernels numpy's OpenBLAS uses, restarting the process if needed.

    The faiss-cpu wheel bundles its own OpenBLAS; an older one may not recognise a recent (or virtualised) CPU
    and fall back to generic kernels (e.g. ``Prescott``, SSE3) while numpy's OpenBLAS runs ``SkylakeX``
    (AVX-512) kernels -- several times slower GEMM for faiss, which would flatter the cutoff. When the two
    differ, the script re-runs itself with ``OPENBLAS_CORETYPE`` set to numpy's kernels (read at library
    load, so it has to be in the environment from the start). Returns the core type forced, if any.
    """
    import faiss  # noqa: F401  (loads its OpenBLAS)
    from threadpoolctl import threadpool_info

    blas = [i for i in threadpool_info() if i.get("internal_api") == "openblas"]
    faiss_arch = next((i.get("architecture") for i in blas if "faiss" in i["filepath"]), None)
    numpy_arch = next((i.get("architecture") for i in blas if "faiss" not in i["filepath"]), None)
    if "OPENBLAS_CORETYPE" in os.environ:
        return os.environ["OPENBLAS_CORETYPE"]
    if as_is or not faiss_arch or not numpy_arch or faiss_arch == numpy_arch:
        return None
    print(
        f"faiss's OpenBLAS runs {faiss_arch} kernels, numpy's {numpy_arch}: "
        f"re-running with OPENBLAS_CORETYPE={numpy_arch}"
    )
    sys.stdout.flush()
    os.environ["OPENBLAS_CORETYPE"] = numpy_arch
    os.execv(sys.executable, [sys.executable, *sys.argv])
    return None  # pragma: no cover - execv does not return


def kept_ok(got: np.ndarray, cos: np.ndarray, t: float, k: int | None) -> tuple[bool, str]:
    """Whether docids ``got`` (best first) are ``Top_k({d : cos >= t})`` up to EPS at the threshold and at the cap."""
    lo, hi = int((cos >= t + EPS).sum()), int((cos >= t - EPS).sum())
    if k is not None:
        lo, hi = min(lo, k), min(hi, k)
    if not lo <= len(got) <= hi:
        return False, f"{len(got)} kept, brute force keeps {lo}..{hi}"
    if not len(got):
        return True, ""
    rest = np.ones(len(cos), bool)
    rest[got] = False
    if cos[got].min() < t - EPS or (rest.any() and cos[rest].max() > cos[got].min() + EPS):
        return False, "a kept document scores below the threshold or below a dropped one"
    if np.any(np.diff(cos[got]) > EPS):
        return False, "not sorted by score"
    return True, ""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--docs", type=int, default=100_000)
    ap.add_argument("--queries", type=int, default=1000)
    ap.add_argument("--dim", type=int, default=384)
    ap.add_argument("--k", type=int, default=1000, help="top-k depth, and the cap (num_results) of the cutoffs")
    ap.add_argument("--p", type=float, default=0.9, help="share of the relevant-item law the CDF cutoff keeps")
    ap.add_argument("--repeats", type=int, default=3, help="timed rounds (each method once per round)")
    ap.add_argument("--threads", type=int, default=None, help="threads for faiss and numpy (default: all CPUs)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--faiss-blas-as-is",
        action="store_true",
        help="keep the kernels faiss's bundled OpenBLAS picks even when they are older than numpy's (see above)",
    )
    ap.add_argument("--quick", action="store_true", help="tiny sizes (5,000 x 64, 100 queries, k 100), smoke test")
    ap.add_argument("--out", default=None, help="JSON output (default benchmarks/results/cutoff_speed.json)")
    a = ap.parse_args()
    if a.quick:
        a.docs, a.queries, a.dim, a.k, a.repeats = 5000, 100, 64, 100, 2
    quick_out = os.path.join(tempfile.gettempdir(), "cutoff_speed_quick.json")  # a smoke test is not a result
    out_path = a.out or (quick_out if a.quick else "benchmarks/results/cutoff_speed.json")

    threads = set_threads(a.threads)
    coretype = fix_faiss_blas(a.faiss_blas_as_is)
    import faiss
    import pyterrier as pt  # noqa: F401  (pyterrier-dr's retrievers need it initialised)

    from pyterrier_prob import (
        CDFCutoffRetriever,
        DenseIndex,
        ScoreCutoffRetriever,
        TopKRetriever,
        threshold_search,
    )
    from pyterrier_prob.index.exact import DOC_BATCH, QUERY_BATCH
    from st_extensions import BetaCosine

    load_before = os.getloadavg()[0]  # other jobs on the machine show here
    t0 = time.perf_counter()
    data = make_data(a.docs, a.queries, a.dim, a.seed)
    tmp = tempfile.TemporaryDirectory(prefix="cutoff_speed_")
    index = DenseIndex(os.path.join(tmp.name, "docs.flex"))
    index.indexer(mode="overwrite").index(
        pd.DataFrame({"docno": [f"d{i}" for i in range(a.docs)], "doc_vec": list(data["docs"])})
    )
    D = np.ascontiguousarray(index.vectors())  # what every method searches (normalised at indexing)
    Q = data["queries"]
    frame = pd.DataFrame({"qid": [f"q{i}" for i in range(a.queries)], "query_vec": list(Q), "query_temp": data["tau"]})
    thresholds = np.asarray(BetaCosine.from_temperature(data["tau"]).cutoff(a.p), dtype=np.float64)
    flat = faiss.IndexFlatIP(a.dim)
    flat.add(D)
    setup_s = time.perf_counter() - t0

    cdf = CDFCutoffRetriever(index, p=a.p, family="beta", num_results=a.k)
    topk = TopKRetriever(index, num_results=a.k)
    score = ScoreCutoffRetriever(index, threshold=float(np.median(thresholds)), num_results=a.k)
    dr_np = index.np_retriever(num_results=a.k)
    dr_faiss = index.faiss_flat_retriever()
    dr_faiss.num_results = a.k  # the factory has no num_results argument (default 1000)

    def all_scores() -> float:
        acc = 0.0
        for q0 in range(0, len(Q), QUERY_BATCH):
            for c0 in range(0, len(D), DOC_BATCH):
                S = Q[q0 : q0 + QUERY_BATCH] @ D[c0 : c0 + DOC_BATCH].T
                acc += float(S[0, 0])
        return acc

    methods: dict[str, Callable[[], object]] = {
        "faiss_flat_search": lambda: flat.search(Q, a.k),
        "cdf_cutoff": lambda: cdf.transform(frame),
        "cdf_threshold_search": lambda: threshold_search(index, Q, thresholds, a.k),
        "dr_np_retriever": lambda: dr_np.transform(frame),
        "dr_faiss_flat_retriever": lambda: dr_faiss.transform(frame),
        "topk": lambda: topk.transform(frame),
        "score_cutoff": lambda: score.transform(frame),
        "all_scores_numpy": all_scores,
    }

    # ---- warm-up round, whose outputs are checked ----------------------------------------------------------
    outs = {name: fn() for name, fn in methods.items()}
    rng = np.random.default_rng(a.seed + 1)
    check_q = rng.choice(a.queries, min(N_CHECK, a.queries), replace=False)
    cdf_out, topk_out = outs["cdf_cutoff"], outs["topk"]
    cdf_groups = dict(tuple(cdf_out.groupby("qid", sort=False)))
    topk_groups = dict(tuple(topk_out.groupby("qid", sort=False)))
    f_scores, f_ids = outs["faiss_flat_search"]
    hits = outs["cdf_threshold_search"]
    checks = {"cdf_vs_brute_force": True, "threshold_search_vs_transform": True, "faiss_vs_topk": True}
    overlaps = []
    for i in check_q:
        qid = f"q{i}"
        cos = D.astype(np.float64) @ Q[i].astype(np.float64)
        rows = cdf_groups.get(qid, cdf_out.iloc[:0])
        got = rows["docid"].to_numpy(np.int64)
        ok, why = kept_ok(got, cos, thresholds[i], a.k)
        if not ok:
            checks["cdf_vs_brute_force"] = False
            print(f"CHECK FAILED: CDF cutoff, query {qid}: {why}")
        core = hits.docids[hits.offsets[i] : hits.offsets[i + 1]]
        if not np.array_equal(core, got):
            checks["threshold_search_vs_transform"] = False
            print(f"CHECK FAILED: threshold_search and CDFCutoffRetriever differ on {qid}")
        t_ids = topk_groups[qid]["docid"].to_numpy(np.int64)
        t_sc = topk_groups[qid]["score"].to_numpy(np.float64)
        overlaps.append(len(np.intersect1d(t_ids, f_ids[i])) / a.k)
        ok_t, why_t = kept_ok(t_ids, cos, -np.inf, a.k)
        if not ok_t or not np.allclose(t_sc, f_scores[i], atol=EPS) or overlaps[-1] < 0.99:
            checks["faiss_vs_topk"] = False
            print(f"CHECK FAILED: faiss top-k vs TopKRetriever on {qid}: {why_t} overlap {overlaps[-1]:.4f}")
    counts = cdf_out.groupby("qid").size().reindex(frame["qid"], fill_value=0).to_numpy()
    kept = {
        "mean": float(counts.mean()),
        "median": float(np.median(counts)),
        "p10": float(np.percentile(counts, 10)),
        "p90": float(np.percentile(counts, 90)),
        "min": int(counts.min()),
        "max": int(counts.max()),
        "share_at_cap": float((counts == a.k).mean()),
        "share_empty": float((counts == 0).mean()),
    }
    score_counts = outs["score_cutoff"].groupby("qid").size().reindex(frame["qid"], fill_value=0).to_numpy()
    del outs, cdf_out, topk_out, cdf_groups, topk_groups, hits

    # ---- timed rounds: every method once per round, order rotated ------------------------------------------
    names = list(methods)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(a.repeats):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            t = time.perf_counter()
            res = methods[name]()
            times[name].append(time.perf_counter() - t)
            del res
    med = {name: statistics.median(ts) for name, ts in times.items()}

    def ratio(x: str, y: str) -> float:  # median over rounds of the paired per-round ratio
        return statistics.median(tx / ty for tx, ty in zip(times[x], times[y]))

    pairs = [
        ("cdf_cutoff", "faiss_flat_search"),
        ("cdf_threshold_search", "faiss_flat_search"),
        ("cdf_cutoff", "dr_np_retriever"),
        ("cdf_cutoff", "dr_faiss_flat_retriever"),
        ("cdf_cutoff", "topk"),
        ("topk", "faiss_flat_search"),
        ("score_cutoff", "faiss_flat_search"),
        ("dr_np_retriever", "faiss_flat_search"),
        ("dr_faiss_flat_retriever", "faiss_flat_search"),
        ("all_scores_numpy", "faiss_flat_search"),
        ("cdf_cutoff", "all_scores_numpy"),
    ]
    ratios = {f"{x} / {y}": ratio(x, y) for x, y in pairs}
    main_ratio = ratios["cdf_cutoff / faiss_flat_search"]
    met = main_ratio <= TARGET

    blas = {}
    try:
        from threadpoolctl import threadpool_info

        blas = {
            i["filepath"].rsplit("/", 1)[-1]: i.get("architecture")
            for i in threadpool_info()
            if i["user_api"] == "blas"
        }
    except Exception:  # pragma: no cover - informational only
        pass
    result = {
        "machine": {
            **describe(),
            "threads": threads,
            "blas_kernels": blas,
            "openblas_coretype_forced": coretype,
            "faiss": faiss.__version__,
            "loadavg_1min_before_after": [load_before, os.getloadavg()[0]],
        },
        "docs": a.docs,
        "queries": a.queries,
        "dim": a.dim,
        "k": a.k,
        "p": a.p,
        "family": "beta",
        "query_temp_range": [float(data["tau"].min()), float(data["tau"].max())],
        "clusters": data["clusters"],
        "seed": a.seed,
        "repeats": a.repeats,
        "setup_seconds": setup_s,
        "threshold_stats": {
            "min": float(thresholds.min()),
            "median": float(np.median(thresholds)),
            "max": float(thresholds.max()),
        },
        "cdf_kept_per_query": kept,
        "score_cutoff_threshold": score.threshold,
        "score_cutoff_kept_mean": float(score_counts.mean()),
        "checks": {**checks, "queries_checked": len(check_q), "faiss_topk_overlap_min": float(min(overlaps))},
        "seconds_median": med,
        "seconds_all_rounds": times,
        "ratios_median_per_round": ratios,
        "target": f"cdf_cutoff / faiss_flat_search <= {TARGET}",
        "target_met": met,
    }

    print(json.dumps(result["machine"]))
    print(
        f"{a.docs} docs x {a.dim} dims, {a.queries} queries, k = {a.k}, p = {a.p} (beta), {threads} threads, "
        f"{a.repeats} timed rounds (setup {setup_s:.1f} s)"
    )
    th = result["threshold_stats"]
    print(f"thresholds t_q: min {th['min']:.3f}, median {th['median']:.3f}, max {th['max']:.3f}")
    print(
        f"CDF cutoff kept per query: mean {kept['mean']:.1f}, median {kept['median']:.0f}, p10 {kept['p10']:.0f}, "
        f"p90 {kept['p90']:.0f}, min {kept['min']}, max {kept['max']}, at cap {kept['share_at_cap']:.1%}, "
        f"empty {kept['share_empty']:.1%}"
    )
    print(
        f"checks on {len(check_q)} queries: " + ", ".join(f"{c} {'ok' if v else 'FAILED'}" for c, v in checks.items())
    )
    print(f"{'method':26s} {'s (median)':>11s}   all rounds")
    for name in names:
        print(f"{name:26s} {med[name]:11.4f}   " + " ".join(f"{x:.4f}" for x in times[name]))
    print(f"{'ratio (median of per-round ratios)':52s}")
    for key, value in ratios.items():
        print(f"  {key:50s} {value:6.3f}")
    print(f"target cdf_cutoff / faiss_flat_search <= {TARGET}: {main_ratio:.3f} -> {'met' if met else 'NOT met'}")
    os.makedirs(os.path.dirname(out_path) or ".", exist_ok=True)
    with open(out_path, "w") as f:
        json.dump(result, f, indent=2)
    tmp.cleanup()
    if not all(checks.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
