"""The VarCrossEncoder experiment (``pyterrier-prob varce``): CrossEncoder against VarCrossEncoder re-rankers.

VarCrossEncoder (``shared/papers/var-cross-encoder.md``) replaces a cross-encoder's linear ranker by a Gaussian
latent z ~ N(mu(t), Sigma(t)) of the [CLS] vector t (Eq. 3-7) and a linear decoder s = z^T W + b (Eq. 8), trained
with binary cross-entropy on sampled scores plus beta * KL(N(mu, Sigma) || N(0, I)) (the variational information
bottleneck, Eq. 10, 17-21). At inference a (query, document) pair's score is a Gaussian with mean
E[s] = mu^T W + b (Eq. 22), by which the paper ranks, and variance W^T Sigma W (Eq. 23). Collections, training,
BM25, ``pt.Experiment`` and the report come from :mod:`pyterrier_prob.experiments.harness`. The protocol:

1. from the same backbone (``--model``, default the packaged all-MiniLM-L6-v2) fine-tune three re-rankers with the
   same rows, steps, batch size, learning rate (10% warm-up), seed and ``max_seq_length``:

   * ``CE``: a one-label cross-encoder with ``BinaryCrossEntropyLoss``: the VarCEs' backbone and [CLS] pooling and a
     linear ranker (:func:`st_extensions.cross_encoder.frozen.build_cross_encoder`) trained at the VarCE head's rate;
   * ``VarCE-MEANVAR`` and ``VarCE-VAR``: :func:`~st_extensions.cross_encoder.build_var_cross_encoder` (the two
     probabilistic modules of Sec. 3.2.1) with :class:`~st_extensions.losses.VariationalBCELoss` (``--beta``,
     default 1e-7, one Monte Carlo sample);

   the rows (:func:`pyterrier_prob.varce.data.cross_encoder_training_data`) are, per train query, one
   judged-relevant document (label 1; a query's relevant documents cycled across rounds) and ``--negatives``
   documents (label 0) from the top ``--pool-depth`` of BM25 and of the untrained model as a dense retriever, in turn
   (``--negatives-from``), minus every document judged for it (the paper's 1 : 4 ratio of Sec. 4.3, scaled to 1 : 3
   by default; ``--positive-depth`` keeps only positives those first stages retrieve). ``--recipe partial`` trains
   the top ``--train-layers`` layers and the heads on cached lower-layer pair states, and the three re-rankers then
   score every pair in one pass through their shared lower layers
   (:func:`~st_extensions.partial.predict_sharing_layers`); with a dev split each model is the one at its best point
   of a dev learning curve (``--dev-queries``, ``--dev-every``; :class:`~pyterrier_prob.curves.DevCurve`), and the
   risk-aware lambda is chosen on dev, as is the alpha of each re-ranker's interpolation with BM25 (the
   ``<re-ranker>+BM25`` rows of ``summary.json``'s ``rerank_rows``: alpha * z(E[s]) + (1 - alpha) * z(BM25) per query,
   :mod:`pyterrier_prob.fusion`; the out-of-domain collections use nfcorpus' alpha, zero-shot). ``--recipe full``
   fine-tunes the backbone and the head (the encoder at ``--lr``, the VarCE head at
   ``VariationalHead.learning_rate``); ``--recipe frozen`` (the default) keeps the
   backbone as pre-trained and trains only each head, on the backbone's [CLS] features of every training pair
   computed once per run and shared by the three re-rankers (:mod:`st_extensions.cross_encoder.frozen`), every head
   at the VarCE head's declared rate (``VariationalHead.learning_rate``; ``--lr`` is then unused); the test
   re-ranking then reads the same kind of cache, so the backbone runs once per (query, document) pair whichever
   heads score it;
2. re-rank the BM25 (PISA) top ``--depth`` of every test query (those with a judged-relevant document, at most
   ``--max-queries`` of them, seeded) with each model -- the VarCEs through
   :class:`~pyterrier_prob.varce.VarCrossEncoderReranker`, keeping E[s] and std[s] -- and compare BM25 and the
   re-rankers in ``pt.Experiment`` with nDCG@10 and RR@10 (= MRR@10), paired t-tests against CE (Sec. 5, Table 2);
   ``--ood`` adds further collections, evaluated zero-shot the same way on at most ``--ood-queries`` queries at
   depth ``--ood-depth`` (as does ``--test-dataset``, for one collection, with the full protocol);
3. is the uncertainty informative? per VarCE and collection: the spread of std[s] (5/50/95%, the median
   within-query coefficient of variation), Spearman's rho between each query's mean std[s] over its top 10 and
   its nDCG@10 (and, for reference, the same with the mean E[s]), and the risk-aware ranking
   E[s] - lambda * std[s] for lambda in ``--risks`` (paired t-tests against lambda = 0);
4. hard queries (Sec. 5, Table 8, :func:`~pyterrier_prob.varce.hard_query_table`): every system on the bottom
   50% of the queries by nDCG@10 under CE (the paper's choice) and, for reference, under BM25, with %no (the
   share of queries with no relevant document in the top 10);
5. robustness (Sec. 4.5.2, Table 4): the six one-word perturbations of
   :func:`~pyterrier_prob.varce.all_noise` (RD, RS, SE, SR, WEI, WES) applied to a seeded subset of
   ``--robust-queries`` test queries; BM25 retrieves its top ``--robust-depth`` with the perturbed query and every
   re-ranker re-ranks them, so the table measures the whole pipeline; nDCG@10 against the clean queries (same
   queries, same depth) and paired t-tests against CE under the same perturbation. SR needs WordNet
   (``apt-get install wordnet-base``); without it SR is skipped with a note (:func:`build_noises`) and the other
   perturbations run.

Every re-ranker scores each distinct (collection, query, document) once (a per-model cache, kept under
``output/scores/`` for ``--reuse`` runs of the same models), so the clean robustness run and the risk sweep reuse
the main run's scores. Nothing is calibrated, so every query of the test split is reported (also when the collection
has no dev split). With no train split or ``--steps 0`` nothing is fine-tuned and ``--model`` is evaluated as it is:
a saved VarCrossEncoder (:func:`st_extensions.load_model`) as ``VarCE-<variant>``, a CrossEncoder as ``CE`` (a
backbone gets the three re-rankers with untrained heads, which the report flags). The VarCE/CE inference-time ratio
is ``benchmarks/varce_inference.py``.

The defaults are sized for about 12 minutes on 2 CPU cores (nfcorpus; encoding the pairs dominates): the harness'
budget (1000 steps of 64) on at most :data:`FROZEN_GROUPS` training groups under the frozen recipe (their pairs are
encoded once; the heads train over them for several epochs), every test query at depth 20, 20 robustness queries at
depth 10, no ``--ood`` collection. The
former benchmark (39 minutes) is ``pyterrier-prob varce --steps 150 --depth 100 --robust-queries 40
--robust-depth 20 --ood irds:beir/scifact irds:cranfield irds:vaswani``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import math
import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from pyterrier_prob.console import library_bars
from pyterrier_prob.experiments.harness import (
    CommonConfig,
    Data,
    Harness,
    add_common_arguments,
    common_from_args,
    markdown_table,
    p_mark,
)

__all__ = [
    "DESCRIPTION",
    "MEASURES",
    "NOISE_ORDER",
    "PairScorer",
    "VarceJobConfig",
    "add_arguments",
    "build_noises",
    "config_from_args",
    "ranked",
    "run",
    "run_varce_job",
    "uncertainty_stats",
]

DESCRIPTION = (
    "VarCrossEncoder (uncertainty-aware cross-encoder re-ranking): fine-tune a CrossEncoder (BCE) and two "
    "VarCrossEncoders (MEANVAR, VAR; variational BCE, Eq. 10) with the same budget on 1:N BM25-negative rows, "
    "re-rank the BM25 candidates of the test collection, compare them with pt.Experiment (nDCG@10, RR@10, paired "
    "t-tests against CE), and report the score uncertainty (spread, correlation with nDCG@10, risk-aware ranking), "
    "the hard queries (Table 8) and the robustness to six query perturbations (Table 4)."
)

BASELINE = "CE"
VARIANTS = ("MEANVAR", "VAR")
SYSTEMS = ("BM25", BASELINE, *(f"VarCE-{v}" for v in VARIANTS))
"""System names in the result tables, in order; significance is tested against ``BASELINE`` (BM25 when no CE is
evaluated)."""

MEASURES = ("nDCG@10", "RR@10")
NOISE_ORDER = ("RD", "RS", "SE", "SR", "WEI", "WES")
NEGATIVE_SOURCES = ("bm25", "dense")
CE_HEAD_PARAMETERS = r"^model\.2\.linear\.(weight|bias)$"
"""The parameters of the CE's linear ranker (``build_cross_encoder``'s module 2, a ``Dense``) as the trainer names them
(through the loss)."""
SCORE_CHUNK = 256  # pairs per progress-bar step


@dataclass
class VarceJobConfig(CommonConfig):
    """Settings of :func:`run_varce_job` (the ``pyterrier-prob varce`` options); the shared ones are
    :class:`~pyterrier_prob.experiments.harness.CommonConfig`'s.

    Attributes:
        negatives: BM25 negatives per judged-relevant document in the training rows.
        pool_depth: the BM25 depth the negatives are drawn from.
        beta: weight of the KL term of VariationalBCELoss (Eq. 10).
        depth: BM25 candidates re-ranked per test query.
        max_queries: a seeded sample of at most this many test queries (None: all).
        risks: lambda values of the risk-aware ranking E[s] - lambda * std[s] (0 is always included).
        robust_queries: test queries (seeded) of the robustness table (0: no robustness table).
        robust_depth: BM25 candidates re-ranked per (perturbed) query in the robustness table.
        noise: the perturbations of the robustness table (abbreviations of :data:`NOISE_ORDER`).
        ood: further collections evaluated zero-shot (their test split).
        ood_queries, ood_depth: seeded query cap and re-ranking depth on each ``ood`` collection.
        inference_batch_size: pairs per forward pass when scoring.
        negatives_from: the first stages the training negatives are mined from, in turn: ``bm25`` and ``dense``
            (the untrained base model as a bi-encoder).
        dev_queries: dev queries (seeded) of the learning curve: every ``dev_every`` steps the model re-ranks their
            BM25 top ``dev_depth`` and its dev nDCG@10 is recorded; the model kept is the one at the best dev point
            (0: no curve, the last step's model).
        dev_every: steps between dev points (None: a tenth of the steps).
        extra_depths: shallower re-ranking depths also reported, from the same scores (BM25's top k re-ranked).
        positive_depth: train only on the judged-relevant documents that a negative source ranks in its top k (the
            candidates a re-ranker sees; None: every judged-relevant document).
        teacher: distil the re-rankers from a fine-tuned bi-encoder fused with BM25 instead of training them on the
            labels (:mod:`pyterrier_prob.experiments.varce_distill`): a saved bi-encoder's folder, or ``"partial"``
            to fine-tune one first (the MNRL baseline, top ``train_layers`` layers, into ``output/teacher/model``).
    """

    output: str = "outputs/varce"
    negatives: int = 3
    pool_depth: int = 30
    beta: float = 1e-7
    depth: int = 20
    max_queries: int | None = None
    risks: Sequence[float] = (0.0, 0.5, 1.0, 2.0)
    robust_queries: int = 20
    robust_depth: int = 10
    noise: Sequence[str] = NOISE_ORDER
    ood: Sequence[str] = ()
    ood_queries: int = 60
    ood_depth: int = 20
    inference_batch_size: int = 32
    negatives_from: Sequence[str] = ("bm25", "dense")
    extra_depths: Sequence[int] = (20,)
    positive_depth: int | None = None
    dev_queries: int = 100
    dev_depth: int = 30
    dev_every: int | None = None
    teacher: str | None = None

    def check(self) -> None:
        """Raise ``ValueError`` naming the first setting out of range."""
        super().check()
        for name in ("negatives", "pool_depth", "depth", "robust_depth", "ood_queries", "ood_depth"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        bad = [n for n in self.negatives_from if n not in NEGATIVE_SOURCES]
        if bad or not self.negatives_from:
            raise ValueError(f"--negatives-from: choose one or more of {list(NEGATIVE_SOURCES)}, got {bad or '[]'}")
        if self.dev_queries < 0 or self.dev_depth < 1:
            raise ValueError(
                f"--dev-queries must be >= 0 and --dev-depth >= 1, got {self.dev_queries} and {self.dev_depth}"
            )
        if self.positive_depth is not None and self.positive_depth < 1:
            raise ValueError(f"--positive-depth must be >= 1, got {self.positive_depth}")
        if any(d < 1 for d in self.extra_depths):
            raise ValueError(f"--extra-depths must be >= 1, got {list(self.extra_depths)}")
        if self.dev_every is not None and self.dev_every < 1:
            raise ValueError(f"--dev-every must be >= 1, got {self.dev_every}")
        if self.inference_batch_size < 1:
            raise ValueError(f"--inference-batch-size must be >= 1, got {self.inference_batch_size}")
        if self.pool_depth < self.negatives:
            raise ValueError(f"--pool-depth ({self.pool_depth}) must be at least --negatives ({self.negatives})")
        if not (math.isfinite(self.beta) and self.beta >= 0):
            raise ValueError(f"--beta must be finite and >= 0, got {self.beta}")
        if self.max_queries is not None and self.max_queries < 1:
            raise ValueError(f"--max-queries must be >= 1, got {self.max_queries}")
        if self.robust_queries < 0:
            raise ValueError(f"--robust-queries must be >= 0, got {self.robust_queries}")
        if not self.risks or any(not math.isfinite(r) for r in self.risks):
            raise ValueError(f"--risks must be finite numbers, got {list(self.risks)}")
        bad = [n for n in self.noise if n not in NOISE_ORDER]
        if bad:
            raise ValueError(f"--noise: unknown perturbations {bad}; choose from {list(NOISE_ORDER)}")


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The ``pyterrier-prob varce`` options."""
    d = VarceJobConfig()
    add_common_arguments(ap, d)
    g = ap.add_argument_group("VarCrossEncoder")
    g.add_argument("--negatives", type=int, default=d.negatives, help="BM25 negatives per relevant training doc")
    g.add_argument("--pool-depth", type=int, default=d.pool_depth, help="BM25 depth the negatives come from")
    g.add_argument("--beta", type=float, default=d.beta, help="KL weight of VariationalBCELoss (Eq. 10)")
    g.add_argument("--depth", type=int, default=d.depth, help="BM25 candidates re-ranked per test query")
    g.add_argument("--max-queries", type=int, default=d.max_queries, help="seeded cap on test queries (None: all)")
    g.add_argument(
        "--risks", type=float, nargs="+", default=list(d.risks), help="lambda of the risk-aware E[s] - lambda*std[s]"
    )
    r = ap.add_argument_group("robustness (Table 4)")
    r.add_argument("--robust-queries", type=int, default=d.robust_queries, help="seeded test queries (0: skip)")
    r.add_argument("--robust-depth", type=int, default=d.robust_depth, help="BM25 depth per perturbed query")
    r.add_argument("--noise", nargs="+", choices=list(NOISE_ORDER), default=list(d.noise), help="perturbations")
    o = ap.add_argument_group("zero-shot collections")
    o.add_argument(
        "--ood",
        nargs="*",
        default=list(d.ood),
        help="further collections to evaluate zero-shot (test split), e.g. irds:beir/scifact irds:cranfield",
    )
    o.add_argument("--ood-queries", type=int, default=d.ood_queries, help="seeded query cap per --ood collection")
    o.add_argument("--ood-depth", type=int, default=d.ood_depth, help="BM25 depth re-ranked per --ood collection")
    g.add_argument("--inference-batch-size", type=int, default=d.inference_batch_size, help="pairs per forward pass")
    g.add_argument(
        "--negatives-from",
        nargs="+",
        choices=list(NEGATIVE_SOURCES),
        default=list(d.negatives_from),
        help="first stages the training negatives are mined from, in turn (dense: the untrained base bi-encoder)",
    )
    g.add_argument(
        "--extra-depths",
        type=int,
        nargs="*",
        default=list(d.extra_depths),
        help="shallower depths also reported (the same scores, BM25's top k re-ranked)",
    )
    g.add_argument(
        "--positive-depth",
        type=int,
        default=d.positive_depth,
        help="positives only among the negative sources' top k (default: every judged-relevant document)",
    )
    c = ap.add_argument_group("learning curve (dev)")
    c.add_argument("--dev-queries", type=int, default=d.dev_queries, help="seeded dev queries (0: no curve)")
    c.add_argument("--dev-depth", type=int, default=d.dev_depth, help="BM25 depth re-ranked per dev query")
    c.add_argument("--dev-every", type=int, default=d.dev_every, help="steps between dev points (default: steps/10)")
    t = ap.add_argument_group("distillation")
    t.add_argument(
        "--teacher",
        default=d.teacher,
        help="distil CE and VarCEs from this fine-tuned bi-encoder (a folder; 'partial': fine-tune one first) fused "
        "with BM25, into split-attention students (default: train on the labels)",
    )


def config_from_args(a: argparse.Namespace) -> VarceJobConfig:
    return VarceJobConfig(
        **common_from_args(a),
        negatives=a.negatives,
        pool_depth=a.pool_depth,
        beta=a.beta,
        depth=a.depth,
        max_queries=a.max_queries,
        risks=tuple(a.risks),
        robust_queries=a.robust_queries,
        robust_depth=a.robust_depth,
        noise=tuple(a.noise),
        ood=tuple(a.ood),
        ood_queries=a.ood_queries,
        ood_depth=a.ood_depth,
        inference_batch_size=a.inference_batch_size,
        negatives_from=tuple(a.negatives_from),
        extra_depths=tuple(a.extra_depths),
        positive_depth=a.positive_depth,
        dev_queries=a.dev_queries,
        dev_depth=a.dev_depth,
        dev_every=a.dev_every,
        teacher=a.teacher,
    )


def run(cfg: VarceJobConfig) -> dict[str, Any]:
    if cfg.teacher:
        from pyterrier_prob.experiments import varce_distill

        return varce_distill.run(varce_distill.config_from_varce(cfg))
    return run_varce_job(cfg)


# --------------------------------------------------------------------------------------------------------------
# scoring and ranking
# --------------------------------------------------------------------------------------------------------------


class PairScorer:
    """Scores (query, document) pairs with one re-ranker, each distinct (collection, query, docno) once.

    A VarCrossEncoder scores through :class:`~pyterrier_prob.varce.VarCrossEncoderReranker` (risk 0), which gives
    ``score_mean`` = E[s] = mu^T W + b (Eq. 22) and ``score_std`` = sqrt(W^T Sigma W) (Eq. 23); any other
    CrossEncoder through ``predict`` with the identity activation (logits), std NaN.

    Args:
        name: the system name (progress bars).
        model: the re-ranker.
        batch_size: pairs per forward pass.
        cache_path: a TSV the scores are appended to as they come, and read back when its first line holds the
            same ``fingerprint`` (None: memory only).
        fingerprint: what identifies the model's scores (None: no file cache).
        fresh: start the score file afresh instead of reading it (a run without ``--reuse``).
        progress: ``(iterable, desc, total, unit) -> iterable`` for a progress bar (e.g. ``Harness.progress``).
    """

    def __init__(
        self,
        name: str,
        model: Any,
        batch_size: int = 32,
        cache_path: str | None = None,
        fingerprint: str | None = None,
        fresh: bool = False,
        progress: Callable[..., Any] | None = None,
    ) -> None:
        from st_extensions.cross_encoder import VarCrossEncoder

        self.name, self.model, self.batch_size = name, model, int(batch_size)
        self.var = isinstance(model, VarCrossEncoder)
        self._reranker = None
        if self.var:
            from pyterrier_prob.varce import VarCrossEncoderReranker

            self._reranker = VarCrossEncoderReranker(model, batch_size=self.batch_size, verbose=False)
        self.cache: dict[tuple[str, str, str], tuple[float, float]] = {}
        self.seconds, self.pairs = 0.0, 0
        self.progress = progress or (lambda it, desc, total=None, unit="it": it)
        self.cache_path = cache_path if fingerprint is not None else None
        self.fingerprint = fingerprint
        self.loaded = 0
        if self.cache_path is not None:
            self._open_cache(fresh)

    def _open_cache(self, fresh: bool) -> None:
        head = f"# {self.fingerprint}\n"
        if not fresh and os.path.isfile(self.cache_path):
            with open(self.cache_path, encoding="utf8") as f:
                if f.readline() == head:
                    for line in f:
                        parts = line.rstrip("\n").split("\t")
                        if len(parts) == 5:
                            self.cache[(parts[0], parts[1], parts[2])] = (float(parts[3]), float(parts[4]))
                    self.loaded = len(self.cache)
                    return
        os.makedirs(os.path.dirname(os.path.abspath(self.cache_path)), exist_ok=True)
        with open(self.cache_path, "w", encoding="utf8") as f:
            f.write(head)

    def add(self, collection: str, scored: Iterable[tuple[str, str, float, float]], seconds: float = 0.0) -> None:
        """Record ``(query, docno, E[s], std[s])`` scores computed elsewhere (e.g. by
        :func:`~st_extensions.partial.predict_sharing_layers`), appending them to the score file."""
        lines = []
        for q, d, m, sd in scored:
            self.cache[(collection, q, d)] = (float(m), float(sd))
            lines.append(f"{collection}\t{q}\t{d}\t{float(m)!r}\t{float(sd)!r}\n")
        self.seconds += seconds
        self.pairs += len(lines)
        if self.cache_path is not None:
            with open(self.cache_path, "a", encoding="utf8") as f:
                f.writelines(lines)

    def score(self, collection: str, cand: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
        """``(E[s], std[s])`` of every row of ``cand`` (``qid, query, docno, text``), in its order."""
        import torch

        keys = [(collection, q, d) for q, d in zip(cand["query"], cand["docno"])]
        todo = cand[[k not in self.cache for k in keys]].drop_duplicates(["query", "docno"])
        starts = range(0, len(todo), SCORE_CHUNK)
        bar = self.progress(starts, f"scoring {self.name}", len(starts), "chunk") if len(todo) else ()
        for start in bar:
            part = todo.iloc[start : start + SCORE_CHUNK]
            t0 = time.perf_counter()
            if self.var:
                out = self._reranker(part[["qid", "query", "docno", "text"]])
                new = zip(out["query"], out["docno"], out["score_mean"], out["score_std"])
            else:
                mean = self.model.predict(
                    list(zip(part["query"], part["text"])),
                    batch_size=self.batch_size,
                    activation_fn=torch.nn.Identity(),
                    show_progress_bar=False,
                )
                new = zip(part["query"], part["docno"], np.asarray(mean).reshape(-1), [math.nan] * len(part))
            self.add(collection, new, time.perf_counter() - t0)
        vals = np.array([self.cache[k] for k in keys], dtype=np.float64).reshape(-1, 2)
        return vals[:, 0], vals[:, 1]


def ranked(cand: pd.DataFrame, mean: np.ndarray, std: np.ndarray, risk: float = 0.0) -> pd.DataFrame:
    """The candidates re-ranked by E[s] - risk * std[s] (risk 0: E[s], Eq. 22; ties keep the BM25 order).

    Returns ``qid, docno, score, score_mean, score_std, bm25_rank, rank`` (rank from 0).
    """
    from pyterrier_prob.varce import risk_adjusted

    score = np.asarray(mean, dtype=np.float64) if risk == 0 else risk_adjusted(mean, std, risk)
    out = pd.DataFrame(
        {
            "qid": cand["qid"].to_numpy(),
            "docno": cand["docno"].to_numpy(),
            "score": score,
            "score_mean": mean,
            "score_std": std,
            "bm25_rank": cand["rank"].to_numpy(),
        }
    )
    out = out.sort_values(["qid", "score", "bm25_rank"], ascending=[True, False, True], kind="stable")
    out["rank"] = out.groupby("qid").cumcount()
    return out.reset_index(drop=True)


def uncertainty_stats(run: pd.DataFrame, ndcg: pd.Series) -> dict[str, Any]:
    """Is std[s] (Eq. 23) informative? Its spread, and Spearman's rho of each query's mean std[s] over its top 10
    with its nDCG@10 (``ndcg``, qid-indexed); the same with the mean E[s] (Eq. 22) as a score-based reference, and
    the rank correlation of std[s] with E[s] over all pairs."""
    from scipy.stats import spearmanr

    def rho(a: pd.Series, b: pd.Series) -> tuple[float, float]:
        if a.nunique() < 2 or b.nunique() < 2:
            return math.nan, math.nan
        r, p = spearmanr(a, b)
        return float(r), float(p)

    top = run[run["rank"] < 10]
    u = top.groupby("qid")["score_std"].mean().reindex(ndcg.index)
    m = top.groupby("qid")["score_mean"].mean().reindex(ndcg.index)
    ok = u.notna()
    r_std, p_std = rho(u[ok], ndcg[ok])
    r_mean, p_mean = rho(m[ok], ndcg[ok])
    within = run.groupby("qid")["score_std"].agg(lambda s: s.std(ddof=0) / s.mean() if s.mean() > 0 else math.nan)
    # the spread of std[s] between queries (SD of the per-query means) and between the pairs of a query (mean
    # within-query SD), and the between-query share of its variance over all pairs
    by_query = run.groupby("qid")["score_std"]
    total_var = float(run["score_std"].var(ddof=0))
    between_var = float(((by_query.transform("mean") - run["score_std"].mean()) ** 2).mean())
    r_pairs, _ = rho(run["score_std"], run["score_mean"])
    q05, q50, q95 = (float(x) for x in np.quantile(run["score_std"], [0.05, 0.5, 0.95]))
    return {
        "n_queries": int(ok.sum()),
        "rho_top10_std_vs_nDCG@10": r_std,
        "p_top10_std": p_std,
        "rho_top10_mean_vs_nDCG@10": r_mean,
        "p_top10_mean": p_mean,
        "std_q05": q05,
        "std_q50": q50,
        "std_q95": q95,
        "std_within_query_cv_median": float(np.nanmedian(within)) if within.notna().any() else math.nan,
        "std_between_queries_sd": float(by_query.mean().std(ddof=0)),
        "std_within_query_sd_mean": float(by_query.std(ddof=0).mean()),
        "std_between_query_variance_share": between_var / total_var if total_var > 0 else math.nan,
        "rho_pairs_std_vs_mean": r_pairs,
    }


# --------------------------------------------------------------------------------------------------------------
# collections, queries, models
# --------------------------------------------------------------------------------------------------------------


def _eval_queries(
    topics: pd.DataFrame, qrels: pd.DataFrame, cap: int | None, seed: int
) -> tuple[pd.DataFrame, pd.DataFrame, int]:
    """The evaluated queries: those with a judged-relevant document (whitespace-normalised, at most ``cap``,
    seeded, sorted by qid) and the qrels with negative labels (cranfield's -1) counted as 0.
    Returns ``(topics, qrels, number of queries with a relevant document)``."""
    from pyterrier_prob.varce.data import normalise_query

    qrels = qrels.assign(qid=qrels["qid"].astype(str), label=qrels["label"].clip(lower=0))
    relevant = set(qrels.loc[qrels["label"] >= 1, "qid"])
    t = topics.assign(qid=topics["qid"].astype(str), query=topics["query"].map(normalise_query))
    t = t[t["qid"].isin(relevant) & (t["query"] != "")]
    available = len(t)
    if cap is not None and cap < len(t):
        t = t.sample(n=cap, random_state=seed)
    t = t.sort_values("qid").reset_index(drop=True)[["qid", "query"]]
    return t, qrels[qrels["qid"].isin(set(t["qid"]))].reset_index(drop=True), available


def _given_model(spec: str | None) -> tuple[str, Any]:
    """What ``--model`` is: ``("var", model)`` a saved VarCrossEncoder, ``("cross", model)`` a CrossEncoder,
    ``("backbone", None)`` anything else (a base encoder the re-rankers are built on)."""
    if spec is None or not os.path.isdir(spec):
        return "backbone", None
    from sentence_transformers import CrossEncoder

    from st_extensions import load_model
    from st_extensions.cross_encoder import VarCrossEncoder

    if not os.path.isfile(os.path.join(spec, "modules.json")):
        try:
            with open(os.path.join(spec, "config.json"), encoding="utf8") as f:
                archs = json.load(f).get("architectures") or []
        except (OSError, ValueError):
            archs = []
        if any(a.endswith("ForSequenceClassification") for a in archs):
            return "cross", CrossEncoder(spec, device="cpu")
        return "backbone", None
    model = load_model(spec, device="cpu")
    if isinstance(model, VarCrossEncoder):
        return "var", model
    if isinstance(model, CrossEncoder):
        return "cross", model
    return "backbone", None


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """transformers' and sentence-transformers' warnings off for the duration (the load report of a new head)."""
    import logging

    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    st_logger = logging.getLogger("sentence_transformers")
    st_level = st_logger.level
    hf_logging.set_verbosity_error()
    st_logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)
        st_logger.setLevel(st_level)


def _fingerprint(h: Harness, name: str, trained: bool, cfg: VarceJobConfig) -> str | None:
    """What identifies a model's scores across runs: its saved training settings, or the given model's files;
    None (no score file) for an untrained head."""
    if trained:
        path = h.path("models", name, "train_settings.json")
        if not os.path.isfile(path):
            return None
        with open(path, encoding="utf8") as f:
            settings = json.load(f).get("settings")
        text = json.dumps(settings, sort_keys=True)
    elif cfg.model and os.path.isdir(cfg.model):
        files = sorted(os.listdir(cfg.model))
        stamp = [(f, os.path.getmtime(os.path.join(cfg.model, f))) for f in files]
        text = json.dumps([os.path.realpath(cfg.model), cfg.max_seq_length, stamp])
    else:
        return None
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class _PairFeatures:
    """The frozen recipe's one cache of backbone [CLS] features per run
    (:class:`~st_extensions.cross_encoder.frozen.CachedPairFeatures`): every re-ranker is built on the same
    pre-trained backbone with the same ``max_seq_length`` and sees the same training rows and BM25 candidates, so each
    (query, document) pair goes through the backbone once and every head reads its features from here."""

    def __init__(self, h: Harness, batch_size: int) -> None:
        self.h, self.batch_size = h, int(batch_size)
        self.cache: Any = None
        self.pairs_encoded = 0

    def extend(self, model: Any, pairs: Sequence[tuple[str, str]]) -> None:
        """Compute (one bar) the features of the ``pairs`` not cached yet with ``model``'s backbone."""
        from st_extensions.cross_encoder.frozen import CachedPairFeatures, encode_pairs

        keys = list(dict.fromkeys((q, d) for q, d in pairs if isinstance(q, str) and isinstance(d, str)))
        new = keys if self.cache is None else self.cache.missing(keys)
        if not new and self.cache is not None:
            return
        if not new:  # an empty cache, filled as pairs come
            features = encode_pairs(model, new)
        else:
            with self.h.stage("pair_features", f"computing the backbone's [CLS] features of {len(new)} pairs (once)"):
                features = encode_pairs(model, new, batch_size=self.batch_size, show_progress_bar=self.h.verbose)
        if self.cache is None:
            self.cache = CachedPairFeatures(new, features, encoder=model)
        else:
            self.cache.extend(new, features)
        self.pairs_encoded += len(new)

    def cached(self, model: Any) -> Any:
        """``model`` reading its features from the cache (its head shared); ``model`` itself when its head is not
        separate from the backbone (a given sequence-classification CrossEncoder)."""
        from st_extensions.cross_encoder.frozen import cached_cross_encoder, pair_prefix_length

        try:
            pair_prefix_length(model)
        except ValueError:
            return model
        if self.cache is None:
            self.extend(model, [])
        return cached_cross_encoder(model, cache=self.cache, batch_size=self.batch_size)

    def prefetch(self, collection: str, cand: pd.DataFrame, scorers: Mapping[str, PairScorer]) -> None:
        """The features, in one pass, of the candidate pairs that some scorer has not scored yet (a pair missed here
        would still be computed once, on first use, by the cache's backbone)."""
        if self.cache is None:  # no re-ranker reads cached features
            return
        keys = zip(cand["query"], cand["docno"])
        todo = np.array([any((collection, q, d) not in sc.cache for sc in scorers.values()) for q, d in keys], bool)
        part = cand[todo] if len(cand) else cand
        if len(part):
            self.extend(self.cache.encoder[0], list(zip(part["query"], part["text"])))


class _SharedLayers:
    """Under the partial recipe every re-ranker keeps the base model's embeddings and lower L - N layers as they were
    (only the top N layers and the head train), so a (query, document) pair needs those lower layers once for all
    re-rankers: :func:`~st_extensions.partial.predict_sharing_layers` runs them once per batch and each model's own
    top layers and head on their output (the same scores as each model's ``predict``, in fp32)."""

    def __init__(self, models: Mapping[str, Any], frozen: int, batch_size: int, progress: Callable[..., Any]) -> None:
        self.models, self.frozen, self.batch_size, self.progress = dict(models), frozen, int(batch_size), progress
        self.pairs = 0

    @classmethod
    def find(cls, cfg: VarceJobConfig, models: Mapping[str, Any], trained: bool, progress: Callable[..., Any]) -> Any:
        """The sharing of ``models`` (None unless they were fine-tuned under the partial recipe and really share
        their lower layers)."""
        from st_extensions.partial import check_partial_transformer, state_fingerprint

        if cfg.recipe != "partial" or not trained or len(models) < 2:
            return None
        try:
            backbones = [check_partial_transformer(list(m)[0]) for m in models.values()]
        except (ValueError, TypeError, IndexError):
            return None
        frozen = len(backbones[0].encoder.layer) - int(cfg.train_layers)
        prints = {state_fingerprint(list(m)[0], frozen) for m in models.values()}
        return cls(models, frozen, cfg.inference_batch_size, progress) if len(prints) == 1 else None

    def prefetch(self, collection: str, cand: pd.DataFrame, scorers: Mapping[str, PairScorer]) -> None:
        """Score, in one pass for all re-rankers, the candidate pairs that some scorer has not scored yet."""
        from st_extensions.partial import predict_sharing_layers

        keys = list(zip(cand["query"], cand["docno"]))
        todo = np.array([any((collection, q, d) not in sc.cache for sc in scorers.values()) for q, d in keys], bool)
        part = cand[todo].drop_duplicates(["query", "docno"]) if len(cand) else cand
        names = [n for n in scorers if n in self.models]
        chunk = SCORE_CHUNK * 4
        starts = range(0, len(part), chunk)
        bar = self.progress(starts, f"scoring {', '.join(names)} (shared lower layers)", len(starts), "chunk")
        for start in bar if len(part) else ():
            p = part.iloc[start : start + chunk]
            t0 = time.perf_counter()
            out = predict_sharing_layers(
                [self.models[n] for n in names],
                list(zip(p["query"], p["text"])),
                self.frozen,
                batch_size=self.batch_size,
            )
            seconds = (time.perf_counter() - t0) / len(names)
            for n, (mean, std) in zip(names, out):
                std = np.full(len(p), math.nan) if std is None else std
                scorers[n].add(collection, zip(p["query"], p["docno"], mean, std), seconds)
            self.pairs += len(p)


def _head_learning_rate() -> float:
    """The rate every head trains at under the frozen recipe: the VarCE head's declared one (a cached model holds
    nothing but its head, so the trainer's rate is the head's; the CE's linear head gets the same)."""
    from st_extensions.cross_encoder import VariationalHead

    return float(VariationalHead.learning_rate)


#: Most training groups (1 relevant + ``negatives`` rows each) under the frozen recipe: about one round over
#: nfcorpus/train's queries; each pair is encoded once, and the heads then train over them for several epochs.
FROZEN_GROUPS = 2000


def _groups(cfg: VarceJobConfig) -> int:
    """Training groups: enough rows for every step (full recipe), at most :data:`FROZEN_GROUPS` (frozen recipe)."""
    from pyterrier_prob.varce.data import groups_for

    n = groups_for(cfg.steps, cfg.batch_size, cfg.negatives)
    return min(n, FROZEN_GROUPS) if cfg.recipe == "frozen" else n


def _train_on_features(
    h: Harness,
    features: _PairFeatures,
    name: str,
    build: Callable[[], Any],
    loss: Callable[[Any], Any],
    data: Callable[[], Any] | None,
    *,
    settings: Mapping[str, Any],
) -> tuple[Any, list[float]]:
    """:meth:`Harness.train` for the frozen recipe: the head trains through
    :func:`~st_extensions.cross_encoder.frozen.cached_cross_encoder` on the run's feature cache (at its declared
    learning rate; the backbone does not move), and the full model is saved, reused and recorded as any other."""
    from pyterrier_prob.training import fine_tune
    from st_extensions.cross_encoder.frozen import cached_cross_encoder

    rate = _head_learning_rate()

    def fit(model: Any, rows: Any, recipe: Any) -> list[float]:
        features.extend(model, list(zip(rows["query"], rows["document"])))
        cached = cached_cross_encoder(model, cache=features.cache)
        # the stand-in holds only the head: it trains in full, at the head's rate
        head = dataclasses.replace(recipe, mode="full", learning_rate=rate, checkpoint_every=0)
        return fine_tune(
            cached,
            loss(cached),
            rows,
            head,
            show_progress=h.verbose,
            desc=f"training {name} (head on cached backbone features)",
        )

    return h.train(name, build, loss, data, settings={**settings, "head_learning_rate": rate}, fit=fit)


def _models(cfg: VarceJobConfig, h: Harness, data: Data, features: _PairFeatures | None = None) -> dict[str, Any]:
    """The re-rankers (module docstring): fine-tuned with the same rows and budget, or ``--model`` as it is.
    The training negatives come from the train collection's BM25 (``Harness.bm25``). With ``features`` (the frozen
    recipe) the heads train on the run's cached backbone features."""
    import torch
    from sentence_transformers.cross_encoder.losses import BinaryCrossEntropyLoss

    from pyterrier_prob.varce.data import cross_encoder_training_data
    from st_extensions import default_model_path
    from st_extensions.cross_encoder import build_var_cross_encoder
    from st_extensions.cross_encoder.frozen import build_cross_encoder
    from st_extensions.losses import VariationalBCELoss

    kind, given = _given_model(cfg.model)
    if data.train and kind == "var":
        raise ValueError(
            f"--model {cfg.model} is a saved VarCrossEncoder: evaluate it with --steps 0 (or on a collection without "
            "a train split), or pass its backbone to fine-tune the three re-rankers"
        )
    notes: list[str] = []
    info: dict[str, Any] = {"model_kind": kind}
    if data.train is None and kind in ("var", "cross"):
        name = f"VarCE-{given.head.variant}" if kind == "var" else BASELINE
        model, _ = h.train(name, lambda: given, lambda m: None, None)
        notes.append(f"{name}: {cfg.model} evaluated as given (no fine-tuning)")
        return {"models": {name: model}, "losses": {}, "trained": False, "notes": notes, "info": info}

    base = cfg.model or default_model_path()
    rows_cache: dict[str, Any] = {}

    def rows() -> Any:
        if "rows" not in rows_cache:
            coll = data.train_collection
            stages = _negative_sources(cfg, h, coll, base)
            with h.stage(
                "training_rows",
                f"building the training rows from {coll.name}/{data.train} (1 relevant : {cfg.negatives} negatives "
                f"from {' and '.join(stages)})",
            ):
                rows_cache["rows"], rows_cache["info"] = cross_encoder_training_data(
                    coll,
                    data.train,
                    stages,
                    n_groups=_groups(cfg),
                    negatives=cfg.negatives,
                    pool_depth=cfg.pool_depth,
                    seed=cfg.seed,
                    positive_depth=cfg.positive_depth,
                )
        return rows_cache["rows"]

    def build(variant: str | None) -> Callable[[], Any]:
        def make() -> Any:
            torch.manual_seed(cfg.seed)  # the same head initialisation with and without training
            if variant is None:  # [CLS] -> a linear ranker: the VarCEs' backbone and pooling, the standard CE head
                return build_cross_encoder(base, max_seq_length=cfg.max_seq_length, device="cpu")
            return build_var_cross_encoder(base, variant=variant, max_seq_length=cfg.max_seq_length, device="cpu")

        return make

    train = rows if data.train else None
    settings = {
        "train": f"{data.train_collection.name}/{data.train}",
        "negatives": cfg.negatives,
        "pool_depth": cfg.pool_depth,
        "negatives_from": list(cfg.negatives_from),
        **({"positive_depth": cfg.positive_depth} if cfg.positive_depth is not None else {}),
    }
    curves: dict[str, Any] = {}
    evaluate = _dev_evaluator(cfg, h, data) if train is not None and features is None else None
    if evaluate is not None:
        settings.update(dev_queries=cfg.dev_queries, dev_depth=cfg.dev_depth, dev_every=_dev_every(cfg))

    def callbacks(name: str) -> list[Any]:
        if evaluate is None:
            return []
        from pyterrier_prob.curves import DevCurve

        curves[name] = DevCurve(_dev_every(cfg), evaluate, path=h.path("curves", f"{name}.json"))
        return [curves[name]]

    def fit(name: str, make: Callable[[], Any], loss: Callable[[Any], Any], **kw: Any) -> tuple[Any, list[float]]:
        if features is not None:
            return _train_on_features(h, features, name, make, loss, train, **kw)
        return h.train(name, make, loss, train, callbacks=callbacks(name), **kw)

    models, losses = {}, {}
    # the CE's new linear ranker (module 2, a Dense) trains at the rate the VarCE heads declare, as a new head should
    head_rate = {} if features is not None else {"learning_rate_mapping": {CE_HEAD_PARAMETERS: _head_learning_rate()}}
    models[BASELINE], losses[BASELINE] = fit(
        BASELINE, build(None), BinaryCrossEntropyLoss, settings=settings, **head_rate
    )
    for v in VARIANTS:
        name = f"VarCE-{v}"
        models[name], losses[name] = fit(
            name,
            build(v),
            lambda m: VariationalBCELoss(m, beta=cfg.beta, num_samples=1),
            settings={**settings, "variant": v, "beta": cfg.beta, "num_samples": 1},
        )
    for name in models:  # the curve of a reused model is the one its training wrote
        path = h.path("curves", f"{name}.json")
        if os.path.isfile(path):
            with open(path, encoding="utf8") as f:
                info.setdefault("dev_curves", {})[name] = json.load(f)
    if train is None:
        notes.append(
            f"nothing fine-tuned: the three re-rankers are {base} with untrained (seeded) heads, so their scores "
            "carry no relevance signal; pass a trained CrossEncoder or VarCrossEncoder with --model"
        )
    if "info" in rows_cache:
        info["training_rows"] = rows_cache["info"]
    return {"models": models, "losses": losses, "trained": train is not None, "notes": notes, "info": info}


def _negative_sources(
    cfg: VarceJobConfig, h: Harness, coll: Any, base: str
) -> dict[str, Callable[[pd.DataFrame], pd.DataFrame]]:
    """The first stages the training negatives are mined from (``--negatives-from``): ``BM25`` (the collection's
    PISA index) and ``dense`` (the untrained base model as a bi-encoder, exhaustive search of its index)."""
    stages: dict[str, Callable[[pd.DataFrame], pd.DataFrame]] = {}
    k = max(cfg.pool_depth, cfg.positive_depth or 0)  # the negatives come from the top pool_depth of these
    if "bm25" in cfg.negatives_from:
        index = h.bm25(coll)
        stages["BM25"] = lambda t: h.bm25_run(index, t, k)
    if "dense" in cfg.negatives_from:
        from sentence_transformers import SentenceTransformer

        from pyterrier_prob import ProbBiEncoder

        with _quiet_transformers():
            start, _ = h.train("dense-untrained", lambda: SentenceTransformer(base, device="cpu"), None, None)
        encoder = ProbBiEncoder(start, batch_size=64, verbose=False)
        dense = h.dense_index("dense-untrained", encoder, coll)
        dense.verbose = library_bars()  # pyterrier-dr's inner "NumpyRetriever scoring" bar (not at default verbosity)
        stages["dense"] = encoder.query_encoder() >> dense.np_retriever(num_results=k)
    return stages


def _dev_every(cfg: VarceJobConfig) -> int:
    return cfg.dev_every or max(1, cfg.steps // 10)


def _dev_evaluator(cfg: VarceJobConfig, h: Harness, data: Data) -> Callable[[Any], float] | None:
    """``model -> dev nDCG@10``: the model re-ranks BM25's top ``--dev-depth`` of ``--dev-queries`` (seeded) queries
    of the dev split (None without a dev split or with ``--dev-queries 0``: test queries are never used)."""
    import torch

    from pyterrier_prob.varce import per_query

    if not cfg.dev_queries or data.dev is None or data.cal_topics.empty:
        if cfg.dev_queries:
            data.notes.append("no dev split: no learning curve; each re-ranker is the one of its last step")
        return None
    coll = data.train_collection
    topics, qrels, _ = _eval_queries(data.cal_topics, data.cal_qrels, cfg.dev_queries, cfg.seed)
    cand = h.bm25_run(h.bm25(coll), topics, cfg.dev_depth)[["qid", "docno"]].merge(topics, on="qid")
    texts = coll.doc_texts(set(cand["docno"]))
    pairs = list(zip(cand["query"], cand["docno"].map(texts)))

    def evaluate(model: Any) -> float:
        scores = model.predict(
            pairs, batch_size=cfg.inference_batch_size, activation_fn=torch.nn.Identity(), show_progress_bar=False
        )
        run = cand[["qid", "docno"]].assign(score=np.asarray(scores, dtype=np.float64).reshape(-1))
        return float(per_query(run, qrels, MEASURES[0], topics=topics).mean())

    data.notes.append(
        f"learning curves: dev nDCG@10 of {len(topics)} {coll.name}/{data.dev} queries (BM25 top {cfg.dev_depth} "
        f"re-ranked) every {_dev_every(cfg)} steps; each re-ranker is the one at its best dev point"
    )
    return evaluate


# --------------------------------------------------------------------------------------------------------------
# the job
# --------------------------------------------------------------------------------------------------------------


@dataclass
class _Target:
    """One evaluated collection: its BM25 index, queries, qrels, depth and document texts."""

    label: str
    collection: Any
    split: str
    index: Any
    topics: pd.DataFrame
    qrels: pd.DataFrame
    depth: int
    available: int
    texts: dict[str, str] = dataclasses.field(default_factory=dict)


def run_varce_job(cfg: VarceJobConfig) -> dict[str, Any]:
    """Run the VarCrossEncoder experiment (module docstring) and write its outputs to ``cfg.output``.

    Writes ``results.csv`` (pt.Experiment per collection), ``uncertainty.csv``, ``risk.csv``,
    ``hard_queries.csv``, ``robustness.csv``, ``summary.json`` and ``results.md``; models under ``models/``,
    BM25 indexes under ``indexes/``, the score caches under ``scores/``.

    Returns:
        ``{"results", "uncertainty", "risk", "hard_queries", "robustness": frames, "summary": dict}``.
    """
    from pyterrier_prob.collections import choose_splits, load_collection
    from pyterrier_prob.fusion import choose_alpha
    from pyterrier_prob.varce import hard_query_table, per_query

    cfg.check()
    h = Harness("varce", cfg)
    data = h.load_data(calibrate=False)  # nothing is calibrated: every test query is evaluated
    if data.dev is not None:
        data.notes.append(f"the dev split ({data.cal_source}) is not used: nothing is calibrated")
    features = _PairFeatures(h, cfg.inference_batch_size) if cfg.recipe == "frozen" else None
    trained = _models(cfg, h, data, features)
    data.notes.extend(trained["notes"])
    models = trained["models"]
    systems = ["BM25", *models]
    baseline = BASELINE if BASELINE in models else "BM25"
    var_systems = [n for n in models if n.startswith("VarCE")]

    # ---- the evaluated collections -------------------------------------------------------------------------------
    targets = []
    topics, qrels, available = _eval_queries(data.test_topics, data.test_qrels, cfg.max_queries, cfg.seed)
    if topics.empty:
        raise ValueError(f"{data.test_collection.name}/{data.test} has no query with a judged-relevant document")
    if len(topics) < available:
        data.notes.append(f"a seeded sample of {len(topics)} of the {available} test queries (--max-queries)")
    if len(topics) < len(data.test_topics):
        dropped = len(data.test_topics) - available
        if dropped:
            data.notes.append(f"{dropped} test queries without a judged-relevant document are not evaluated")
        data = dataclasses.replace(data, test_topics=topics, test_qrels=qrels)
    coll = data.test_collection
    targets.append(_Target(coll.name, coll, data.test, h.bm25(coll), topics, qrels, cfg.depth, available))
    for spec in cfg.ood:
        with h.stage("load_ood", f"loading {spec} (zero-shot)"):
            c = load_collection(spec)
            if any(tg.label == c.name for tg in targets):
                data.notes.append(f"--ood {spec}: {c.name} is already evaluated; skipped")
                continue
            split = choose_splits(c).test
            t, q, n = _eval_queries(c.topics(split), c.qrels(split), cfg.ood_queries, cfg.seed)
        if t.empty:
            raise ValueError(f"{c.name}/{split} has no query with a judged-relevant document")
        targets.append(_Target(c.name, c, split, h.bm25(c), t, q, cfg.ood_depth, n))

    def attach_text(target: _Target, cand: pd.DataFrame) -> pd.DataFrame:
        missing = set(cand["docno"]) - set(target.texts)
        if missing:
            target.texts.update(target.collection.doc_texts(missing))
        return cand.assign(text=cand["docno"].map(target.texts))  # a docno without text: the re-ranker says so

    def candidates(target: _Target, topics: pd.DataFrame, depth: int) -> pd.DataFrame:
        res = h.bm25_run(target.index, topics[["qid", "query"]], depth)
        res = res[["qid", "docno", "score", "rank"]].merge(topics[["qid", "query"]], on="qid")
        return attach_text(target, res.sort_values(["qid", "rank"]).reset_index(drop=True))

    scorers = {
        n: PairScorer(
            n,
            m if features is None else features.cached(m),  # frozen: heads on the run's cached backbone features
            cfg.inference_batch_size,
            cache_path=h.path("scores", f"{n}.tsv"),
            fingerprint=_fingerprint(h, n, trained["trained"], cfg),
            fresh=not cfg.reuse,
            progress=h.progress,
        )
        for n, m in models.items()
    }
    shared = None if features is not None else _SharedLayers.find(cfg, models, trained["trained"], h.progress)
    prefetch = features.prefetch if features is not None else shared.prefetch if shared is not None else None

    # ---- effectiveness -------------------------------------------------------------------------------------------
    cands: dict[str, pd.DataFrame] = {}
    runs: dict[str, dict[str, pd.DataFrame]] = {}
    tables = []
    for tg in targets:
        with h.stage(
            f"rerank_{_slug(tg.label)}",
            f"re-ranking BM25's top {tg.depth} of {len(tg.topics)} "
            f"{tg.label}/{tg.split} queries with {', '.join(models)}",
        ):
            cand = candidates(tg, tg.topics, tg.depth)
            cands[tg.label] = cand
            if prefetch is not None:
                prefetch(tg.label, cand, scorers)
            runs[tg.label] = {"BM25": cand[["qid", "docno", "score", "rank"]]}
            for n, sc in scorers.items():
                runs[tg.label][n] = ranked(cand, *sc.score(tg.label, cand))
            exp = h.experiment(runs[tg.label], tg.topics, tg.qrels, MEASURES, baseline=baseline)
        exp.insert(0, "collection", tg.label)
        exp.insert(1, "queries", len(tg.topics))
        exp.insert(2, "depth", tg.depth)
        tables.append(exp)
    results = pd.concat(tables, ignore_index=True)

    # ---- on dev: lambda of the risk-aware ranking, alpha of the interpolation with BM25 ---------------------------
    risks = sorted({0.0, *map(float, cfg.risks)})
    chosen: dict[str, dict[str, Any]] = {}
    alphas: dict[str, dict[str, Any]] = {}
    if models and data.dev is not None and cfg.dev_queries:
        dev_coll = data.train_collection
        dev_topics, dev_qrels, _ = _eval_queries(data.cal_topics, data.cal_qrels, cfg.dev_queries, cfg.seed)
        dev_target = _Target(
            f"{dev_coll.name}/{data.dev}", dev_coll, data.dev, h.bm25(dev_coll), dev_topics, dev_qrels, cfg.depth, 0
        )
        with h.stage(
            "risk_dev",
            f"choosing lambda and alpha on {len(dev_topics)} {dev_target.label} queries (depth {cfg.depth})",
        ):
            cand = candidates(dev_target, dev_topics, cfg.depth)
            if prefetch is not None:
                prefetch(dev_target.label, cand, scorers)
            for n in models:
                mean, std = scorers[n].score(dev_target.label, cand)

                def dev_ndcg(run: pd.DataFrame) -> float:
                    return float(per_query(run, dev_qrels, MEASURES[0], topics=dev_topics).mean())

                alpha, by_alpha = choose_alpha(lambda a: dev_ndcg(_interpolated(cand, mean, a)))  # noqa: B023
                alphas[n] = {"alpha": alpha, "dev_nDCG@10": by_alpha, "dev": dev_target.label}
                if n in var_systems and len(risks) > 1:
                    by_risk = {r: dev_ndcg(ranked(cand, mean, std, r)) for r in risks}
                    best = max(risks, key=lambda r: (by_risk[r], -abs(r)))  # ties: the smaller |lambda|
                    chosen[n] = {"lambda": best, "dev_nDCG@10": by_risk, "dev": dev_target.label}

    rerank_rows = []
    for tg in targets:
        for depth in sorted({tg.depth, *(d for d in cfg.extra_depths if d < tg.depth)}, reverse=True):
            rerank_rows += _rerank_rows(
                tg.label, depth, cands[tg.label], runs[tg.label], tg.topics, tg.qrels, _alpha_of(alphas)
            )

    # ---- uncertainty and risk-aware ranking ----------------------------------------------------------------------
    unc_rows, risk_tables = [], []
    with h.stage("uncertainty", "uncertainty of the VarCE scores and risk-aware ranking"):
        for tg in targets:
            for n in var_systems:
                run_ = runs[tg.label][n]
                ndcg = per_query(run_, tg.qrels, MEASURES[0], topics=tg.topics)
                unc_rows.append({"collection": tg.label, "name": n, **uncertainty_stats(run_, ndcg)})
                mean, std = run_["score_mean"].to_numpy(), run_["score_std"].to_numpy()
                base = run_[["qid", "docno"]].assign(rank=run_["bm25_rank"].to_numpy())
                rr = {f"risk={r:g}": ranked(base, mean, std, r) for r in risks}
                top0 = _top10(rr["risk=0"])
                exp = h.experiment(rr, tg.topics, tg.qrels, MEASURES, baseline="risk=0")
                exp.insert(0, "collection", tg.label)
                exp.insert(1, "model", n)
                exp.insert(2, "risk", risks)
                exp["changed_top10"] = [float((_top10(v) != top0.reindex(_top10(v).index)).mean()) for v in rr.values()]
                exp["chosen_on_dev"] = [n in chosen and r == chosen[n]["lambda"] for r in risks]
                risk_tables.append(exp)
                if n in chosen and tg is targets[0]:
                    row = exp[exp["chosen_on_dev"]].iloc[0]
                    chosen[n].update(
                        {
                            "test": tg.label,
                            "test_nDCG@10": float(row["nDCG@10"]),
                            "test_nDCG@10_at_lambda_0": float(exp.iloc[0]["nDCG@10"]),
                            "p_vs_lambda_0": float(row.get("nDCG@10 p-value", math.nan)),
                        }
                    )
    uncertainty = pd.DataFrame(unc_rows)
    risk = pd.concat(risk_tables, ignore_index=True) if risk_tables else pd.DataFrame()

    # ---- hard queries --------------------------------------------------------------------------------------------
    hard_tables = []
    with h.stage("hard_queries", "hard queries (bottom 50% by nDCG@10 under the baseline)"):
        for tg in targets:
            for under in dict.fromkeys([baseline, "BM25"]):
                tab = hard_query_table(runs[tg.label], tg.qrels, under, list(MEASURES), 0.5, k=10, topics=tg.topics)
                tab.insert(0, "collection", tg.label)
                tab.insert(1, "hard_under", under)
                hard_tables.append(tab)
    hard = pd.concat(hard_tables, ignore_index=True)

    # ---- robustness ----------------------------------------------------------------------------------------------
    robustness, examples, robust_notes = _robustness(cfg, h, targets[0], scorers, candidates, baseline, prefetch)
    data.notes.extend(robust_notes)

    # ---- report --------------------------------------------------------------------------------------------------
    summary = {
        "systems": systems,
        "recipe": _recipe(cfg, trained["trained"], features),
        "dev_curves": trained["info"].get("dev_curves", {}),
        "rerank_rows": rerank_rows,
        "risk_chosen_on_dev": chosen,
        "interpolation_chosen_on_dev": alphas,
        "scored_sharing_lower_layers": (
            None if shared is None else {"frozen_layers": shared.frozen, "pairs": shared.pairs}
        ),
        "significance": f"paired t-test against {baseline!r} (pt.Experiment / scipy.stats.ttest_rel); risk rows "
        "against risk=0; no multiple-test correction",
        "model_kind": trained["info"]["model_kind"],
        "fine_tuned": trained["trained"],
        "training_rows": trained["info"].get("training_rows"),
        "training_loss_first_last": {n: [float(v[0]), float(v[-1])] for n, v in trained["losses"].items() if v},
        "evaluated": {
            tg.label: {
                "split": tg.split,
                "queries": len(tg.topics),
                "queries_available": tg.available,
                "depth": tg.depth,
            }
            for tg in targets
        },
        "scoring": {
            n: {
                "pairs_scored": sc.pairs,
                "pairs_from_earlier_runs": sc.loaded,
                "seconds": round(sc.seconds, 1),
                "pairs_per_s": round(sc.pairs / sc.seconds, 1) if sc.seconds else None,
            }
            for n, sc in scorers.items()
        },
        "robustness_examples": examples,
    }
    md = _markdown(results, uncertainty, risk, hard, robustness, summary, baseline)
    tables_out = {
        "results": results,
        "uncertainty": uncertainty,
        "risk": risk,
        "hard_queries": hard,
        "robustness": robustness,
    }
    summary = h.finish(
        "VarCrossEncoder: CrossEncoder vs VarCrossEncoder re-ranking of BM25",
        md,
        {k: v for k, v in tables_out.items() if not v.empty},
        summary,
        data,
    )
    return {**tables_out, "summary": summary}


def _recipe(cfg: VarceJobConfig, fine_tuned: bool, features: _PairFeatures | None) -> dict[str, Any]:
    """Which training recipe ran (``--recipe``), for the summary and the report's first line."""
    out: dict[str, Any] = {"name": cfg.recipe}
    if features is not None:
        rate = _head_learning_rate()
        out.update(
            backbone="frozen (as pre-trained)",
            head_learning_rate=rate if fine_tuned else None,
            pairs_through_backbone=features.pairs_encoded,
        )
        what = (
            f"each re-ranker's head trained at lr {rate:g} (the VarCE head's declared rate, the CE's linear head "
            "alike) on the backbone's [CLS] features"
            if fine_tuned
            else "nothing fine-tuned; the heads read the backbone's [CLS] features"
        )
        out["description"] = (
            f"**frozen** -- the backbone kept as pre-trained; {what}, computed once per (query, document) pair and "
            f"shared by every re-ranker ({features.pairs_encoded} pairs through the backbone)."
        )
    else:
        from st_extensions.cross_encoder import VariationalHead

        out.update(backbone=f"fine-tuned at lr {cfg.lr:g}" if fine_tuned else "as given")
        out["description"] = (
            f"**full** -- backbone and head fine-tuned together (encoder and CE classifier at lr {cfg.lr:g}, the VarCE "
            f"head at its declared {VariationalHead.learning_rate:g})."
            if fine_tuned
            else "**full** -- nothing fine-tuned; every re-ranker scored with its own backbone."
        )
    return out


def _rerank_rows(
    label: str,
    depth: int,
    cand: pd.DataFrame,
    runs: Mapping[str, pd.DataFrame],
    topics: pd.DataFrame,
    qrels: pd.DataFrame,
    alphas: Mapping[str, float] | None = None,
) -> list[dict[str, Any]]:
    """One row per system for BM25's top ``depth`` re-ranked with the scores of ``runs`` (made at a depth >= this):
    nDCG@10 over ``topics`` and paired t-tests (scipy.stats.ttest_rel, per-query nDCG@10) against BM25 and CE.
    ``alphas`` (re-ranker -> alpha chosen on dev) adds the system ``<re-ranker>+BM25``: BM25's top ``depth`` ranked by
    ``alpha * z(E[s]) + (1 - alpha) * z(BM25)`` (z within each query over those ``depth`` candidates,
    :class:`pyterrier_prob.fusion.ScoreInterpolation`)."""
    from scipy.stats import ttest_rel

    from pyterrier_prob.varce import per_query

    top = cand[cand["rank"] < depth]
    keep = set(zip(top["qid"], top["docno"]))
    per: dict[str, pd.Series] = {}
    for name, run in runs.items():
        if name == "BM25":
            r = top[["qid", "docno", "score", "rank"]]
        else:
            inside = [k in keep for k in zip(run["qid"], run["docno"])]
            r = run[inside].drop(columns=["rank"])
            r = ranked(r.assign(rank=r["bm25_rank"]), r["score_mean"].to_numpy(), r["score_std"].to_numpy())
        per[name] = per_query(r, qrels, MEASURES[0], topics=topics)
        if name != "BM25" and alphas and name in alphas:
            both = top[["qid", "docno", "score", "rank"]].merge(
                r[["qid", "docno", "score_mean"]], on=["qid", "docno"], how="inner", validate="one_to_one"
            )
            fused = _interpolated(both, both["score_mean"].to_numpy(), alphas[name])
            per[f"{name}+BM25"] = per_query(fused, qrels, MEASURES[0], topics=topics)

    def p(a: str, b: str) -> float | None:
        if b not in per or a == b:
            return None
        x, y = per[a].align(per[b], join="inner")
        return float(ttest_rel(x, y).pvalue) if len(x) > 1 and (x != y).any() else 1.0

    return [
        {
            "collection": label,
            "depth": depth,
            "system": name,
            "queries": int(len(v)),
            "nDCG@10": float(v.mean()),
            "p_vs_bm25": p(name, "BM25"),
            "p_vs_CE": p(name, BASELINE),
        }
        for name, v in per.items()
    ]


def _interpolated(cand: pd.DataFrame, mean: np.ndarray, alpha: float) -> pd.DataFrame:
    """BM25's candidates (``qid, docno, score, rank``) ranked by ``alpha * z(E[s]) + (1 - alpha) * z(BM25 score)``
    (:func:`pyterrier_prob.fusion.interpolate`; ties keep the BM25 order)."""
    from pyterrier_prob.fusion import interpolate

    fused = interpolate(cand["qid"], cand["score"].to_numpy(np.float64), mean, alpha)
    return ranked(cand, fused, np.zeros(len(cand)))


def _alpha_of(chosen: Mapping[str, Mapping[str, Any]]) -> dict[str, float]:
    return {n: float(c["alpha"]) for n, c in chosen.items()}


def _top10(run: pd.DataFrame) -> pd.Series:
    return run[run["rank"] < 10].groupby("qid")["docno"].apply(tuple)


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in text.removeprefix("irds:")).strip("_")


def _robustness(
    cfg: VarceJobConfig,
    h: Harness,
    target: _Target,
    scorers: dict[str, PairScorer],
    candidates: Callable[[_Target, pd.DataFrame, int], pd.DataFrame],
    baseline: str,
    prefetch: Callable[[str, pd.DataFrame, Mapping[str, PairScorer]], None] | None = None,
) -> tuple[pd.DataFrame, dict[str, list[list[str]]], list[str]]:
    """Table 4: the clean and perturbed runs of a seeded subset of the test queries (module docstring); ``prefetch``
    (the frozen recipe's :meth:`_PairFeatures.prefetch`) computes the backbone features of the new pairs first."""
    notes: list[str] = []
    if cfg.robust_queries == 0 or not cfg.noise:
        return pd.DataFrame(), {}, notes
    sub = target.topics
    if cfg.robust_queries < len(sub):
        sub = sub.sample(n=cfg.robust_queries, random_state=cfg.seed).sort_values("qid").reset_index(drop=True)
    with h.stage(
        "robustness",
        f"robustness: {len(sub)} {target.label} queries, {len(cfg.noise)} perturbations, "
        f"BM25 top {cfg.robust_depth} of the perturbed query",
    ):
        noises, skipped = build_noises(cfg.noise, cfg.seed)
        for note in skipped:
            if h.verbose:
                print(f"note: {note}", flush=True)
            notes.append(note)
        kinds = [k for k in NOISE_ORDER if k in cfg.noise and k in noises]
        frames = {"clean": (sub, 0)}
        examples: dict[str, list[list[str]]] = {}
        for k in kinds:
            noisy = noises[k](sub[["qid", "query"]])
            changed = noisy["query"] != noisy["query_0"]
            frames[k] = (noisy[["qid", "query"]], int(changed.sum()))
            examples[k] = [[a, b] for a, b in zip(noisy.loc[changed, "query_0"], noisy.loc[changed, "query"])][:3]
        cands = {k: candidates(target, t, cfg.robust_depth) for k, (t, _) in frames.items()}
        union = pd.concat(cands.values(), ignore_index=True)
        if prefetch is not None:
            prefetch(target.label, union, scorers)
        for sc in scorers.values():  # one pass (one bar) per model over every perturbation's new pairs
            sc.score(target.label, union)
        rows = []
        clean_ndcg: dict[str, float] = {}
        for k, cand in cands.items():
            rr = {"BM25": cand[["qid", "docno", "score", "rank"]]}
            for n, sc in scorers.items():
                rr[n] = ranked(cand, *sc.score(target.label, cand))
            exp = h.experiment(rr, sub, target.qrels, MEASURES, baseline=baseline)
            if k == "clean":
                clean_ndcg = dict(zip(exp["name"], exp[MEASURES[0]]))
            exp.insert(0, "perturbation", k)
            exp.insert(1, "changed_queries", frames[k][1])
            exp.insert(2, "queries", len(sub))
            exp[f"{MEASURES[0]} drop"] = [clean_ndcg[n] - v for n, v in zip(exp["name"], exp[MEASURES[0]])]
            rows.append(exp)
    return pd.concat(rows, ignore_index=True), examples, notes


def build_noises(kinds: Sequence[str], seed: int) -> tuple[dict[str, Any], list[str]]:
    """The robustness table's perturbations (abbreviations of :data:`NOISE_ORDER`, in that order) and a note per
    perturbation left out because its resource is missing -- SR without WordNet -- instead of failing the run."""
    from pyterrier_prob.varce.noise import QueryNoise, wordnet_available

    noises: dict[str, Any] = {}
    notes: list[str] = []
    for abbr in (k for k in NOISE_ORDER if k in kinds):
        if abbr == "SR" and not wordnet_available():
            notes.append(
                "robustness: SR (WordNet synonym replacement) skipped: WordNet is missing; install it with "
                "'apt-get install wordnet-base' (or set $WORDNET_DIR to a WordNet dict directory) to run it"
            )
            continue
        try:
            noises[abbr] = QueryNoise(abbr, seed)
        except (OSError, ImportError) as e:  # another missing resource (NLPaug's misspelling dictionary)
            notes.append(f"robustness: {abbr} skipped: {e}")
    return noises, notes


# --------------------------------------------------------------------------------------------------------------
# Markdown
# --------------------------------------------------------------------------------------------------------------


def _cell(row: pd.Series, m: str) -> str:
    return f"{row[m]:.4f}{p_mark(row.get(f'{m} p-value', np.nan))}"


def _markdown(
    results: pd.DataFrame,
    uncertainty: pd.DataFrame,
    risk: pd.DataFrame,
    hard: pd.DataFrame,
    robustness: pd.DataFrame,
    summary: dict[str, Any],
    baseline: str,
) -> str:
    """The job's tables as Markdown (what goes into the README)."""
    lines = [f"Recipe: {summary['recipe']['description']}", "", f"`*`: p < 0.05, {summary['significance']}.", ""]
    rows = summary.get("training_rows")
    if rows:
        lines += [
            f"Training rows: {rows['rows']} from {rows['source']} ({rows['queries']} queries; 1 judged-relevant : "
            f"{rows['negatives_per_group']} negatives, {rows['negatives']}, from {rows.get('negatives_from')}; "
            f"{rows['random_negatives_filled_in']} random negatives filled in; positives: {rows.get('positives')}, "
            f"{rows.get('positives_available')} of {rows.get('relevant_judged')} judged-relevant).",
            "",
        ]
    losses = summary.get("training_loss_first_last") or {}
    if losses:
        lines += [
            "Training loss (first -> last step): "
            + ", ".join(f"{n} {a:.3f} -> {b:.3f}" for n, (a, b) in losses.items()),
            "",
        ]
    lines += ["BM25 candidates re-ranked (nDCG@10, RR@10 = MRR@10):", ""]
    lines += ["| collection | queries | depth | system | nDCG@10 | RR@10 |", "|---|---|---|---|---|---|"]
    for _, r in results.iterrows():
        lines.append(
            f"| {r['collection']} | {r['queries']} | {r['depth']} | {r['name']} | {_cell(r, 'nDCG@10')} | "
            f"{_cell(r, 'RR@10')} |"
        )
    rerank = summary.get("rerank_rows") or []
    if rerank:
        lines += [
            "",
            "nDCG@10 with paired t-tests (scipy.stats.ttest_rel over the queries) against BM25 and against CE, at each "
            "re-ranking depth (the shallower depths re-rank BM25's top k with the same scores):",
            "",
            "| collection | depth | queries | system | nDCG@10 | p vs BM25 | p vs CE |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in rerank:
            pb, pc = (f"{r[k]:.2g}" if r[k] is not None else "" for k in ("p_vs_bm25", "p_vs_CE"))
            lines.append(
                f"| {r['collection']} | {r['depth']} | {r['queries']} | {r['system']} | {r['nDCG@10']:.4f} | {pb} | "
                f"{pc} |"
            )
    curves = summary.get("dev_curves") or {}
    if curves:
        lines += [
            "",
            "Learning curves (dev nDCG@10 against steps; the model kept is the one at its best dev point):",
            "",
        ]
        for n, c in curves.items():
            pts = ", ".join(f"{p['step']}: {p['dev']:.4f}" for p in c.get("points", []))
            best = c.get("best") or {}
            lines.append(f"- {n}: {pts} (best: step {best.get('step')}, {best.get('dev', math.nan):.4f})")
    inter = summary.get("interpolation_chosen_on_dev") or {}
    if inter:
        lines += ["", "Interpolation with BM25 (alpha * z(E[s]) + (1 - alpha) * z(BM25)), alpha chosen on dev:", ""]
        for n, c in inter.items():
            dev = ", ".join(f"{a:g}: {v:.4f}" for a, v in c["dev_nDCG@10"].items())
            lines.append(f"- {n}: dev nDCG@10 by alpha {{{dev}}} -> alpha = {c['alpha']:g} (system {n}+BM25)")
    chosen = summary.get("risk_chosen_on_dev") or {}
    if chosen:
        lines += ["", "Risk-aware ranking with lambda chosen on dev (E[s] - lambda * std[s]):", ""]
        for n, c in chosen.items():
            dev = ", ".join(f"{r:g}: {v:.4f}" for r, v in c["dev_nDCG@10"].items())
            lines.append(
                f"- {n}: dev nDCG@10 by lambda {{{dev}}} -> lambda = {c['lambda']:g}; test nDCG@10 "
                f"{c.get('test_nDCG@10', math.nan):.4f} vs {c.get('test_nDCG@10_at_lambda_0', math.nan):.4f} at "
                f"lambda = 0 (p = {c.get('p_vs_lambda_0', math.nan):.2g})"
            )
    if not uncertainty.empty:
        lines += [
            "",
            "Is the uncertainty informative? std[s] (Eq. 23): its 5/50/95% quantiles over the re-ranked pairs and "
            "median within-query coefficient of variation; Spearman rho of each query's mean std[s] over its top 10 "
            "with its nDCG@10 (and of its mean E[s], for reference); rho of std[s] with E[s] over the pairs.",
            "",
        ]
        u = uncertainty.assign(
            **{
                "std 5/50/95%": [
                    f"{a:.5f} / {b:.5f} / {c:.5f}"
                    for a, b, c in zip(uncertainty["std_q05"], uncertainty["std_q50"], uncertainty["std_q95"])
                ],
                "rho(std, nDCG@10)": [
                    f"{r:.3f}{p_mark(p)}"
                    for r, p in zip(uncertainty["rho_top10_std_vs_nDCG@10"], uncertainty["p_top10_std"])
                ],
                "rho(mean, nDCG@10)": [
                    f"{r:.3f}{p_mark(p)}"
                    for r, p in zip(uncertainty["rho_top10_mean_vs_nDCG@10"], uncertainty["p_top10_mean"])
                ],
            }
        )
        cols = [
            "collection",
            "name",
            "n_queries",
            "std 5/50/95%",
            "std_within_query_cv_median",
            "std_between_queries_sd",
            "std_within_query_sd_mean",
            "std_between_query_variance_share",
            "rho(std, nDCG@10)",
            "rho(mean, nDCG@10)",
            "rho_pairs_std_vs_mean",
        ]
        lines.append(
            markdown_table(
                u[cols].rename(
                    columns={
                        "std_within_query_cv_median": "CV in query",
                        "std_between_queries_sd": "SD between queries",
                        "std_within_query_sd_mean": "SD within query",
                        "std_between_query_variance_share": "between-query share",
                        "rho_pairs_std_vs_mean": "rho(std, mean) pairs",
                    }
                ),
                floatfmt=".3g",
            )
        )
    if not risk.empty:
        riskcols = list(dict.fromkeys(risk["name"]))
        lines += [
            "",
            "Risk-aware ranking E[s] - lambda * std[s]: nDCG@10 (`*` vs lambda = 0; share of queries whose "
            "top 10 changed)",
            "",
        ]
        lines += ["| collection | model | " + " | ".join(riskcols) + " |", "|---|---|" + "---|" * len(riskcols)]
        for (c, m), g in risk.groupby(["collection", "model"], sort=False):
            g = g.set_index("name")
            cells = [f"{_cell(g.loc[x], 'nDCG@10')} ({g.loc[x, 'changed_top10']:.2f})" for x in riskcols]
            lines.append(f"| {c} | {m} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Hard queries (Table 8): the bottom 50% by nDCG@10 under the named system; %no = % of queries with "
        "no relevant document in the top 10.",
        "",
    ]
    cols = [
        "collection",
        "hard_under",
        "name",
        "n_hard",
        "nDCG@10",
        "nDCG@10 hard",
        "RR@10",
        "RR@10 hard",
        "%no",
        "%no hard",
    ]
    lines.append(markdown_table(hard[cols]))
    if not robustness.empty:
        kinds = list(dict.fromkeys(robustness["perturbation"]))
        first = robustness.drop_duplicates("perturbation").set_index("perturbation")
        n = int(first["queries"].iloc[0])
        lines += [
            "",
            f"Robustness (Table 4): nDCG@10 on {n} seeded test queries, BM25 candidates of the (perturbed) "
            f"query; `*` vs {baseline} under the same perturbation; the last row counts the changed queries.",
            "",
        ]
        lines += ["| system | " + " | ".join(kinds) + " |", "|---|" + "---|" * len(kinds)]
        by = robustness.set_index(["perturbation", "name"])
        for name in dict.fromkeys(robustness["name"]):
            lines.append(f"| {name} | " + " | ".join(_cell(by.loc[(k, name)], "nDCG@10") for k in kinds) + " |")
        lines.append(
            "| changed queries | " + " | ".join(f"{first.loc[k, 'changed_queries']}/{n}" for k in kinds) + " |"
        )
    sc = summary["scoring"]
    through = summary["recipe"].get("pairs_through_backbone")
    lines += [
        "",
        "Scoring (each distinct pair once): "
        + ", ".join(
            f"{k} {v['pairs_scored']} pairs" + (f" at {v['pairs_per_s']:.0f} pairs/s" if v["pairs_per_s"] else "")
            for k, v in sc.items()
        )
        + (
            f"; the heads read cached backbone features ({through} pairs, training and test, through the backbone "
            "once), so these rates leave the backbone out."
            if through is not None
            else "."
        ),
    ]
    return "\n".join(lines) + "\n"
