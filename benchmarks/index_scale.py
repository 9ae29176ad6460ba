"""Retrieval at scale: every backend of the search layer against the exact scan at 1M and 10M documents.

For each collection size this builds the backends of :mod:`pyterrier_prob.index.search` over the same vectors and
measures, side by side on the same query batches:

* **range** search -- pEBR's per-query CDF cutoffs ``cos(q, d) >= t_q`` (``shared/papers/pebr.md`` Sec. 4.1.2,
  Appendix A), uncapped: range recall = the share of the exact above-threshold set that the backend returns
  (micro-averaged over all (query, document) pairs of the measured queries);
* **top-k** search (k = 100): recall = |top-k(backend) & top-k(exact)| / k.

Speed-up = median per-batch time of the exact scan / median per-batch time of the backend, both run on every batch
back to back in a rotating order (``--batch`` queries per batch), so machine load hits them alike. ``build_s`` is the
backend's build time (k-means training + adding; the exact scan has none); ``memory_bytes`` the size of its index
(codes, lists and centroids, graph) -- backends that re-score (fp16/SQ8/PQ codes) also read the exact vectors, which
stay on disk as a memmap.

The model and queries: the pEBR (BetaNCE) model ``pyterrier-prob pebr`` trains (``--model``, default
``outputs/pebr/models/pebr``), its nfcorpus document vectors (``outputs/pebr/indexes/pebr-beir-nfcorpus.flex``), the
323 nfcorpus/test queries with their learned temperatures, and the CDF level p that the experiment calibrated on dev
to a mean depth of 100 (``outputs/pebr/results.csv``, row "pEBR CDF cutoff", k = 100). The thresholds are the
model's own ``t_q = F_q^{-1}(1 - p)``. On a large collection many more documents pass them, so a second setting
shifts every t_q by one constant c chosen (on the exact scan) to give a mean depth of each of ``--target-depths``
(100 and 1,000): pEBR's per-query spread of thresholds at depths a serving system would return.

Collections:

* **1M** (``perturbed``): the 3,633 real document vectors, then perturbed copies as ``benchmarks/mol_topk.py`` makes
  its 1M collection: document j takes a uniformly drawn real document b and ``normalise(v_b + sigma z / sqrt(d))``,
  ``z ~ N(0, I)``, sigma 0.5; float32.
* **10M** (``mixture``): sampled from a 64-component diagonal Gaussian mixture (scikit-learn) fitted to the model's
  nfcorpus and scifact document vectors (3,633 + 5,183), normalised, stored as **fp16** (7.7 GB) so that it fits in
  24 GB with its index; the exact scan reads it in float32 chunks.

Backends: exact (the reference blocked scan), ``ivf_flat``, ``hnsw`` and ``hnsw_sq8`` (1M; the HNSW graph over SQ8
codes, re-scored, top-k read 2x deeper), ``ivf_sq8`` (1M and 10M; SQ8 codes,
candidates re-scored from the exact vectors, radius lowered by ``range_slack``), over an ``nprobe`` / ``ef_search``
grid, and the IVF range searches with per-query probes (``probe_margin``: every list whose centroid scores at least
``t_q - margin``, at least ``--min-nprobe``) over a margin grid. Every built index and generated collection is
cached in ``--workdir``; ``--resume`` keeps the sizes that a
previous run finished.

    python benchmarks/index_scale.py                          # 1M and 10M (about an hour on 2 cores)
    python benchmarks/index_scale.py --sizes 1000000 --resume
    python benchmarks/index_scale.py --quick                  # 50k documents, a smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np
import pandas as pd

sys.path.insert(0, os.path.dirname(__file__))
from _machine import describe  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PEBR = os.path.join(ROOT, "outputs", "pebr")
CHUNK = 65536
TOPK = 100


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---- data ------------------------------------------------------------------------------------------------------
def load_model_side(args) -> dict:
    """The pEBR model's nfcorpus document vectors, test queries (vectors, temperatures) and calibrated level p."""
    import pyterrier as pt

    from pyterrier_prob import CDFCutoffRetriever, DenseIndex, ProbBiEncoder

    cache = os.path.join(args.workdir, "model_side.npz")
    res = pd.read_csv(os.path.join(PEBR, "results.csv"))
    row = res[(res["name"] == "pEBR CDF cutoff") & (res["k"] == 100)].iloc[0]
    p = float(str(row["setting"]).split("=")[1])
    index = DenseIndex(os.path.join(PEBR, "indexes", "pebr-beir-nfcorpus.flex"))
    docs = np.asarray(index.vectors(), np.float32)
    if os.path.exists(cache):
        z = np.load(cache)
        return {"docs": docs, "Q": z["Q"], "t": z["t"], "scifact": z["scifact"], "p": p}
    enc = ProbBiEncoder(args.model, batch_size=64)
    topics = pt.get_dataset("irds:beir/nfcorpus/test").get_topics()
    text = "query" if "query" in topics.columns else "text"
    frame = enc.query_encoder()(topics.rename(columns={text: "query"})[["qid", "query"]])
    Q = np.stack(frame["query_vec"]).astype(np.float32)
    Q /= np.linalg.norm(Q, axis=1, keepdims=True)
    t = CDFCutoffRetriever(index, p=p)._thresholds(frame)
    log("encoding the scifact corpus (for the 10M mixture)")
    corpus = pd.DataFrame(pt.get_dataset("irds:beir/scifact").get_corpus_iter(verbose=False))
    texts = (corpus.get("title", "").fillna("") + " " + corpus["text"].fillna("")).str.strip().tolist()
    scifact = enc.encode_docs(texts)
    os.makedirs(args.workdir, exist_ok=True)
    np.savez(cache, Q=Q, t=t, scifact=scifact)
    return {"docs": docs, "Q": Q, "t": t, "scifact": scifact, "p": p}


def perturbed(real: np.ndarray, n: int, path: str, sigma: float = 0.5, seed: int = 0) -> np.memmap:
    """``n`` float32 vectors: the real ones, then perturbed copies (seeded per chunk of 65,536)."""
    d = real.shape[1]
    if os.path.exists(path) and os.path.getsize(path) == n * d * 4:
        return np.memmap(path, np.float32, "r", shape=(n, d))
    tmp = path + ".tmp"
    out = np.memmap(tmp, np.float32, "w+", shape=(n, d))
    out[: len(real)] = real
    for c, a in enumerate(range(len(real), n, CHUNK)):
        b = min(n, a + CHUNK)
        rng = np.random.default_rng([seed, c])
        x = real[rng.integers(0, len(real), b - a)] + sigma * rng.standard_normal((b - a, d), np.float32) / np.sqrt(d)
        out[a:b] = x / np.linalg.norm(x, axis=1, keepdims=True)
    out.flush()
    del out
    os.replace(tmp, path)
    return np.memmap(path, np.float32, "r", shape=(n, d))


def mixture(fit_on: np.ndarray, n: int, path: str, components: int = 64, seed: int = 0) -> np.memmap:
    """``n`` fp16 unit vectors sampled from a diagonal Gaussian mixture fitted to ``fit_on``."""
    from sklearn.mixture import GaussianMixture

    d = fit_on.shape[1]
    if os.path.exists(path) and os.path.getsize(path) == n * d * 2:
        return np.memmap(path, np.float16, "r", shape=(n, d))
    gm = GaussianMixture(components, covariance_type="diag", random_state=seed, max_iter=200).fit(fit_on)
    tmp = path + ".tmp"
    out = np.memmap(tmp, np.float16, "w+", shape=(n, d))
    sd = np.sqrt(gm.covariances_).astype(np.float32)
    for c, a in enumerate(range(0, n, CHUNK)):
        b = min(n, a + CHUNK)
        rng = np.random.default_rng([seed, 1, c])
        k = rng.choice(components, size=b - a, p=gm.weights_)
        x = gm.means_[k].astype(np.float32) + sd[k] * rng.standard_normal((b - a, d), np.float32)
        out[a:b] = (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float16)
    out.flush()
    del out
    os.replace(tmp, path)
    return np.memmap(path, np.float16, "r", shape=(n, d))


# ---- measuring -------------------------------------------------------------------------------------------------
def _sets(hits, n):
    return [hits.docids[hits.offsets[i] : hits.offsets[i + 1]] for i in range(n)]


def range_recall(got, want) -> float:
    total = sum(len(w) for w in want)
    found = sum(np.intersect1d(g, w, assume_unique=True).size for g, w in zip(got, want))
    return found / total if total else 1.0


def depth_shifts(
    exact, Q: np.ndarray, t: np.ndarray, targets: list[int], depth_cap: int
) -> tuple[dict[int, float], np.ndarray]:
    """Per target, the constant c with mean_q |{d : s >= t_q + c}| = target (from each query's exact top
    ``depth_cap``), and each query's depth at its unshifted threshold (capped at ``depth_cap``)."""
    hits = exact.search(Q, -np.inf, depth_cap)
    scores = [hits.scores[hits.offsets[i] : hits.offsets[i + 1]] for i in range(len(Q))]

    def mean_depth(c: float) -> float:
        return float(np.mean([np.count_nonzero(s >= t[i] + c) for i, s in enumerate(scores)]))

    raw = np.array([np.count_nonzero(s >= t[i]) for i, s in enumerate(scores)])
    return {target: _bisect(mean_depth, target, depth_cap) for target in targets}, raw


def _bisect(mean_depth, target: float, depth_cap: int) -> float:
    lo, hi = -1.0, 1.0
    for _ in range(50):
        mid = (lo + hi) / 2
        if mean_depth(mid) > target:
            lo = mid
        else:
            hi = mid
    if mean_depth(hi) >= 0.9 * depth_cap:
        raise RuntimeError("depth cap too small for the target depth")
    return hi


def run_size(args, n: int, side: dict, rows: list) -> dict:
    from pyterrier_prob.index import make_searcher

    kind = "perturbed" if n <= 2_000_000 else "mixture"
    log(f"{n:,} documents ({kind})")
    path = os.path.join(args.workdir, f"docs-{kind}-{n}.{'f4' if kind == 'perturbed' else 'f2'}")
    t0 = time.perf_counter()
    if kind == "perturbed":
        vecs = perturbed(side["docs"], n, path)
    else:
        vecs = mixture(np.concatenate([side["docs"], side["scifact"]]), n, path)
    gen_s = time.perf_counter() - t0
    Q = side["Q"][: args.queries]
    t_model = side["t"][: args.queries]
    exact = make_searcher(vecs, "exact")
    log("calibrating the depth shift on the exact scan")
    shifts, raw_depth = depth_shifts(exact, Q, t_model, args.target_depths, args.depth_cap)
    log(f"  the model's thresholds: mean depth {raw_depth.mean():.0f}, largest {raw_depth.max()} (capped)")
    settings = {f"pebr_t_depth{depth}": t_model + c for depth, c in shifts.items()}
    skipped = None
    if raw_depth.max() < args.depth_cap:
        settings = {"pebr_t": t_model} | settings
    else:  # some query's own threshold admits more than depth_cap documents: a scan of the collection, not a search
        n_over = int((raw_depth >= args.depth_cap).sum())
        skipped = (
            f"pebr_t (the model's thresholds unshifted): {n_over} of {len(raw_depth)} queries admit more than "
            f"{args.depth_cap} documents; not measured"
        )
        log(skipped)

    cache = os.path.join(args.workdir, f"faiss-{n}")
    nlist = args.nlist
    backends = []
    specs = [("ivf_sq8", {"nlist": nlist, "train_size": min(n, 64 * nlist), "range_slack": args.slack})]
    if kind == "perturbed":
        specs.insert(0, ("ivf_flat", {"nlist": nlist, "train_size": min(n, 64 * nlist)}))
        if not args.no_hnsw:
            specs.append(("hnsw", {"M": args.hnsw_m, "ef_construction": args.hnsw_efc}))
            # the graph over 8-bit codes: candidates re-scored from the exact vectors, a top-k 2x deeper first
            sq8 = {"M": args.hnsw_m, "ef_construction": args.hnsw_efc, "k_factor": 2, "range_slack": args.slack}
            specs.append(("hnsw_sq8", sq8))
    specs = [(b, p) for b, p in specs if b in args.backends]
    for backend, params in specs:
        log(f"building {backend} {params}")
        s = make_searcher(vecs, backend, cache_dir=cache, verbose=not args.quiet, **params)
        log(f"  built in {s.build_s:.0f} s, {s.memory_bytes / 2**30:.2f} GiB")
        grid = args.nprobes if backend.startswith("ivf") else args.ef_searches
        key = "nprobe" if backend.startswith("ivf") else "ef_search"
        backends += [(backend, s.with_params(**{key: v})) for v in grid]
        if backend.startswith("ivf"):  # per-query probes for range search: lists within the margin of t_q
            backends += [(backend, s.with_params(nprobe=args.min_nprobe, probe_margin=m)) for m in args.margins]

    nb = (len(Q) + args.batch - 1) // args.batch
    times: dict[tuple, list[float]] = {}
    found: dict[tuple, list] = {}
    truth: dict[tuple, list] = {}
    jobs = [("exact", None, exact)] + [(b, s.setting(), s) for b, s in backends]
    adaptive = {s.setting() for _, s in backends if getattr(s, "probe_margin", None) is not None}
    for bi in range(nb):
        sl = slice(bi * args.batch, (bi + 1) * args.batch)
        order = jobs[bi % len(jobs) :] + jobs[: bi % len(jobs)]
        for name, setting, s in order:
            for sname, thr, k in [("topk", -np.inf, TOPK)] + [(sn, t[sl], None) for sn, t in settings.items()]:
                if setting in adaptive and sname == "topk":
                    continue  # probe_margin shapes range searches only
                a = time.perf_counter()
                hits = s.search(Q[sl], thr, k)
                el = time.perf_counter() - a
                key = (name, setting, sname)
                times.setdefault(key, []).append(el)
                sets = _sets(hits, len(Q[sl]))
                (truth if name == "exact" else found).setdefault(key, []).extend(sets)
        log(f"  batch {bi + 1}/{nb} done")

    out = {"n_docs": n, "collection": kind, "generate_s": round(gen_s, 1), "queries": int(len(Q)), "shift_c": shifts}
    if skipped:
        out["skipped"] = skipped
    exact_mem = int(vecs.nbytes)
    depth = {sn: float(np.mean([len(x) for x in truth[("exact", None, sn)]])) for sn in ["topk", *settings]}
    out["mean_exact_depth"] = depth
    for (name, setting, sname), ts in times.items():
        med = statistics.median(ts)
        ref = statistics.median(times[("exact", None, sname)])
        if name == "exact":
            recall, build, mem = 1.0, 0.0, exact_mem
        else:
            want = truth[("exact", None, sname)]
            got = found[(name, setting, sname)]
            if sname == "topk":
                recall = float(np.mean([np.intersect1d(g, w).size / max(1, len(w)) for g, w in zip(got, want)]))
            else:
                recall = range_recall(got, want)
            s = next(s for b, s in backends if b == name and s.setting() == setting)
            build, mem = s.build_s, s.memory_bytes
        rows.append(
            {
                "n_docs": n,
                "collection": kind,
                "backend": name,
                "search": "topk" if sname == "topk" else "range",
                "thresholds": None if sname == "topk" else sname,
                "setting": setting or "-",
                "recall": round(recall, 5),
                "speedup_vs_exact": round(ref / med, 2),
                "median_batch_s": round(med, 4),
                "batches": len(ts),
                "mean_exact_depth": round(depth[sname], 1),
                "build_s": round(build, 1),
                "memory_bytes": int(mem),
            }
        )
        r = rows[-1]
        log(
            f"  {name:9s} {r['search']:5s} {str(r['thresholds']):22s} {r['setting']:28s} recall {r['recall']:.4f} "
            f"x{r['speedup_vs_exact']:.1f} ({med * 1000:.0f} ms/batch)"
        )
    return out


SEARCHES = {  # (search, thresholds) -> docs/scale.md's label, in its order
    ("topk", None): "top-100",
    ("range", "pebr_t_depth100"): "range, t_q + c₁₀₀",
    ("range", "pebr_t_depth1000"): "range, t_q + c₁₀₀₀",
    ("range", "pebr_t"): "range, t_q (the model's own)",
}


def table(path: str) -> str:
    """docs/scale.md's table from a result file: per size and search, the exact scan and, for each backend, its
    fastest setting with recall >= 0.99 (or its best recall when none reaches it); SQ8's ``range_slack`` not shown."""
    rows = pd.DataFrame(json.load(open(path))["rows"])
    lines = [
        "| documents | search (mean exact depth) | backend | setting | recall | × exact scan | build | index memory |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for n in sorted(rows["n_docs"].unique()):
        for (search, thresholds), label in SEARCHES.items():
            same = (rows["n_docs"] == n) & (rows["search"] == search)
            group = rows[same & (rows["thresholds"].isna() if thresholds is None else rows["thresholds"] == thresholds)]
            for backend in [
                b for b in ("exact", "ivf_flat", "ivf_sq8", "hnsw", "hnsw_sq8") if b in set(group["backend"])
            ]:
                b = group[group["backend"] == backend]
                good = b[b["recall"] >= 0.99]
                r = good.loc[good["speedup_vs_exact"].idxmax()] if len(good) else b.loc[b["recall"].idxmax()]
                exact = backend == "exact"
                speed = f"{r['median_batch_s']:.2f} s / batch" if exact else f"{r['speedup_vs_exact']:.1f}×"
                memory = f"{r['memory_bytes'] / 2**30:.2f} GiB" + (" (fp16)" if exact and n >= 10_000_000 else "")
                setting = ",".join(p for p in r["setting"].split(",") if not p.startswith("range_slack="))
                lines.append(
                    f"| {n:,} | {label} ({r['mean_exact_depth']:,.0f}) | {backend} | {setting} | "
                    f"{r['recall']:.4f} | {speed} | {r['build_s']:.0f} s | {memory} |"
                )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--table", metavar="JSON", help="print docs/scale.md's table from a result file and stop")
    ap.add_argument("--sizes", default="1000000,10000000")
    ap.add_argument("--model", default=os.path.join(PEBR, "models", "pebr"))
    ap.add_argument("--queries", type=int, default=160, help="nfcorpus/test queries measured (of 323)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--nlist", type=int, default=4096, help="IVF lists")
    ap.add_argument("--nprobes", default="16,32,64,128,256,512")
    ap.add_argument("--ef-searches", default="128,512,2048")
    ap.add_argument("--margins", default="0.05,0.1,0.15,0.2,0.25", help="probe_margin grid of IVF range search")
    ap.add_argument("--min-nprobe", type=int, default=4, help="nprobe (the minimum) with probe_margin")
    ap.add_argument("--hnsw-m", type=int, default=32)
    ap.add_argument("--hnsw-efc", type=int, default=80)
    ap.add_argument("--no-hnsw", action="store_true")
    ap.add_argument(
        "--backends",
        type=lambda v: v.split(","),
        default=["ivf_flat", "ivf_sq8", "hnsw", "hnsw_sq8"],
        help="the backends measured beside the exact scan (comma-separated)",
    )
    ap.add_argument("--slack", type=float, default=0.02, help="range_slack of the SQ8 candidate search")
    ap.add_argument("--target-depths", default="100,1000", help="mean exact depths of the shifted thresholds")
    ap.add_argument("--depth-cap", type=int, default=50000, help="exact depth read to set the threshold shifts")
    ap.add_argument("--workdir", default=os.path.join(ROOT, "outputs", "index-scale"))
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "index_scale.json"))
    ap.add_argument("--resume", action="store_true", help="keep the sizes a previous run of --out finished")
    ap.add_argument("--quick", action="store_true", help="50k documents, 64 queries: a smoke test")
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args()
    if args.table:
        print(table(args.table))
        return
    args.nprobes = [int(x) for x in args.nprobes.split(",")]
    args.ef_searches = [int(x) for x in args.ef_searches.split(",")]
    args.target_depths = [int(x) for x in str(args.target_depths).split(",")]
    args.margins = [float(x) for x in args.margins.split(",")]
    if args.quick:
        args.sizes, args.queries, args.nlist, args.depth_cap = "50000", 64, 256, 5000
        args.target_depths = "50,200"
        args.out = os.path.join(args.workdir, "index_scale_quick.json")
    os.makedirs(args.workdir, exist_ok=True)
    import faiss

    faiss.omp_set_num_threads(os.cpu_count() or 1)
    result = {"rows": [], "sizes": {}}
    if args.resume and os.path.exists(args.out):
        result = json.load(open(args.out))
    side = load_model_side(args)
    start = time.perf_counter()
    for n in (int(x) for x in args.sizes.split(",")):
        if str(n) in result["sizes"]:
            log(f"{n:,}: kept from {args.out}")
            continue
        rows: list = []
        info = run_size(args, n, side, rows)
        info["command"] = "python benchmarks/index_scale.py " + " ".join(sys.argv[1:])  # the one that measured n
        result["rows"] = [r for r in result["rows"] if r["n_docs"] != n] + rows
        result["sizes"][str(n)] = info
        result.update(
            {
                "command": "python benchmarks/index_scale.py " + " ".join(sys.argv[1:]),
                "machine": describe() | {"faiss": faiss.__version__, "faiss_threads": faiss.omp_get_max_threads()},
                "model": os.path.relpath(args.model, ROOT),
                "cdf_level_p": side["p"],
                "topk_k": TOPK,
                "batch_queries": args.batch,
                "target_depths": args.target_depths,
                "gpu": "none: no GPU on this machine (gpu_* backends not measured)",
            }
        )
        from pyterrier_prob.atomic import atomic_write

        atomic_write(args.out, json.dumps(result, indent=1) + "\n")
        log(f"wrote {args.out}")
    log(f"total {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
