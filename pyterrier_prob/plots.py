"""Plots of the pEBR study (Sec. 4.4.2: Figure 2, Table 3), of PIT / reliability before and after calibration (issue
#13) and of truncation curves; drawn on a bare :class:`matplotlib.figure.Figure`, written by
:func:`pyterrier_prob.atomic.save_figure`."""

from __future__ import annotations

import os
from collections.abc import Mapping

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from pyterrier_prob.atomic import save_figure
from pyterrier_prob.evaluation import StrataLike, retrieved_counts, strata_series, stratum_order
from pyterrier_prob.validation import choice

_COLOURS = {"head": "tab:red", "torso": "tab:orange", "tail": "tab:blue", "all": "tab:gray"}


def retrieved_count_histogram(
    counts_by_qid: pd.Series | pd.DataFrame | Mapping[str, int],
    strata: StrataLike,
    path: str | os.PathLike,
    title: str = "Retrieved documents per query by stratum (pEBR Figure 2)",
    *,
    bins: int | np.ndarray = 30,
    layout: str = "panels",
    dpi: int = 120,
) -> str:
    """Histogram of the documents retrieved per query, per head/torso/tail stratum -- pEBR Figure 2 (Sec. 4.4.2).

    ``counts_by_qid``: qid-indexed counts, a mapping or a result frame; every query of ``strata`` counts (0 without
    rows); shared bin edges. ``layout``: ``"panels"`` (one per stratum) or ``"overlay"``. Returns ``path``."""
    choice("layout", layout, ("panels", "overlay"))
    s = strata_series(strata)
    counts = retrieved_counts(counts_by_qid, s.index)
    order = stratum_order(s.to_numpy())
    edges = np.histogram_bin_edges(counts.to_numpy(dtype=float), bins=bins)
    panels = layout == "panels"
    fig = Figure(figsize=(4.0 * len(order), 3.6) if panels else (6.4, 4.2), layout="constrained")
    if panels:
        axes = fig.subplots(1, len(order), sharex=True, sharey=True, squeeze=False)[0]
    else:
        axes = [fig.subplots()] * len(order)
    for ax, stratum in zip(axes, order):
        c = counts[s == stratum].to_numpy()
        label = f"{stratum} (n={len(c)}, mean={c.mean():.1f})"
        style = {"alpha": 0.85} if panels else {"histtype": "step", "linewidth": 1.8, "label": label}
        ax.hist(c, bins=edges, color=_COLOURS.get(str(stratum)), **style)
        ax.set(xlabel="retrieved documents per query", title=label if panels else "")
    axes[0].set(ylabel="number of queries")
    if not panels:
        axes[0].legend()
    fig.suptitle(title)
    return save_figure(fig, path, dpi)


def table3_plot(
    grid: pd.DataFrame,
    path: str | os.PathLike,
    title: str = "Mean retrieved documents per query vs. CDF value (pEBR Table 3)",
    *,
    logy: bool = True,
    dpi: int = 120,
) -> str:
    """Line plot of :func:`pyterrier_prob.evaluation.table3_grid` (rows strata, columns p) -- pEBR Table 3."""
    if not isinstance(grid, pd.DataFrame) or grid.empty:
        raise ValueError("grid must be a non-empty frame (rows strata, columns p) from table3_grid")
    ps = np.asarray(grid.columns, dtype=float)
    order = np.argsort(ps)
    fig = Figure(figsize=(6.4, 4.2), layout="constrained")
    ax = fig.subplots()
    for stratum, row in grid.iterrows():
        label = str(stratum)
        ax.plot(ps[order], row.to_numpy(dtype=float)[order], marker="o", label=label, color=_COLOURS.get(label))
    if logy and (grid.to_numpy() > 0).all():
        ax.set_yscale("log")
    ax.set(xlabel="cutoff CDF value p", ylabel="mean retrieved documents per query", title=title)
    ax.legend()
    return save_figure(fig, path, dpi)


def pit_plot(
    pits: Mapping[str, np.ndarray],
    path: str | os.PathLike,
    title: str = "PIT of relevant cosines under the per-query law",
    *,
    bins: int = 20,
    dpi: int = 120,
) -> str:
    """PIT histogram and reliability curve of per-query cosine laws, e.g. before and after calibration (issue #13):
    ``pits``, label -> PIT values (:func:`pyterrier_prob.pebr.calibration.pit_values`); the legend gives n, the KS
    distance D and the share below 0.01. Returns ``path``."""
    if not isinstance(pits, Mapping) or not pits:
        raise ValueError("pits must be a non-empty mapping label -> PIT values")
    clean = {}
    for label, values in pits.items():
        u = np.asarray(values, dtype=float).reshape(-1)
        if u.size == 0 or not np.all((u >= 0.0) & (u <= 1.0)):
            raise ValueError(f"PIT values of {label!r} must be a non-empty array in [0, 1] (no nan)")
        clean[str(label)] = np.sort(u)
    fig = Figure(figsize=(10.0, 4.2), layout="constrained")
    ax_hist, ax_rel = fig.subplots(1, 2)
    edges = np.linspace(0.0, 1.0, bins + 1)
    grid = np.linspace(0.0, 1.0, 501)
    for i, (label, u) in enumerate(clean.items()):
        n = u.size
        ranks = np.arange(1, n + 1) / n
        ks = float(max(np.max(ranks - u), np.max(u - (ranks - 1.0 / n))))
        legend = f"{label} (n={n}, D={ks:.3f}, <0.01: {np.mean(u < 0.01):.1%})"
        colour = f"C{i}"
        ax_hist.hist(u, bins=edges, density=True, histtype="step", linewidth=1.8, color=colour, label=legend)
        ax_rel.plot(grid, np.searchsorted(u, grid, side="right") / n, color=colour, linewidth=1.8, label=legend)
    ax_hist.axhline(1.0, color="black", linestyle=":", linewidth=1.0)
    ax_hist.set(xlim=(0, 1), xlabel="PIT value F_q(cos(q, d+))", ylabel="density")
    ax_hist.set_title("PIT histogram (uniform = calibrated)")
    ax_rel.plot([0.0, 1.0], [0.0, 1.0], color="black", linestyle="--", linewidth=1.0, label="calibrated")
    ax_rel.set(xlim=(0, 1), ylim=(0, 1), xlabel="nominal level u", title="reliability curve")
    ax_rel.set_ylabel("share of relevant pairs with PIT <= u")
    ax_rel.legend(fontsize="small", loc="lower right")
    fig.suptitle(title)
    return save_figure(fig, path, dpi)


def truncation_curves_plot(
    curves: Mapping[str, pd.DataFrame],
    path: str | os.PathLike,
    title: str = "Ranked-list truncation rules: recall, precision and F1 against mean depth",
    *,
    dpi: int = 120,
) -> str:
    """Recall, precision and F1 against the mean number of documents kept per query, one line per truncation rule
    (issue #13): ``curves[rule]`` has columns ``mean_depth``, ``recall``, ``precision``, ``f1``. Log depth axis."""
    fig = Figure(figsize=(13, 4.2))
    axes = fig.subplots(1, 3)
    for ax, col, label in zip(axes, ("recall", "precision", "f1"), ("SetR", "SetP", "F1")):
        for rule, frame in curves.items():
            f = frame[frame["mean_depth"] > 0]
            ax.plot(f["mean_depth"], f[col], marker="o", markersize=3, label=rule)
        ax.set(xscale="log", xlabel="mean documents kept per query", ylabel=label)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    return save_figure(fig, path, dpi=dpi)


def reliability_plot(calibration: Mapping[str, Mapping], path: str | os.PathLike | None = None) -> Figure:
    """Reliability diagram (Guo et al., ICML 2017) of each re-ranker's ``calibration[name]["reliability"]``
    (:func:`pyterrier_prob.varce.calibration.reliability_curve`), its ECE in the legend; saved at ``path`` if given."""
    fig = Figure(figsize=(4.8, 4.4))
    ax = fig.add_subplot()
    ax.plot([0, 1], [0, 1], color="0.7", lw=1, ls="--")
    for name, entry in calibration.items():
        curve = entry["reliability"]
        ax.plot(curve["mean_prob"], curve["frac_relevant"], marker="o", ms=3, label=f"{name} (ECE {entry['ece']:.3f})")
    ax.set(xlabel="predicted P(relevant)", ylabel="fraction judged relevant", xlim=(0, 1), ylim=(0, 1))
    ax.legend(fontsize=8)
    fig.tight_layout()
    if path is not None:
        save_figure(fig, path)
    return fig


def risk_coverage_plot(
    tables: Mapping[str, Mapping[str, Mapping]], system: str, path: str | os.PathLike | None = None
) -> Figure:
    """One panel per collection: the risk-coverage curves (:func:`pyterrier_prob.varce.selective.selective_table`'s
    ``curves``) of ``system``'s confidences, each with its AURC in the legend, beside the best order's and the mean
    risk (a useless confidence); saved at ``path`` if given."""
    labels = [c for c in tables if system in tables[c]]
    if not labels:
        raise ValueError(f"risk_coverage_plot: no collection has a selective-prediction table of {system!r}")
    fig = Figure(figsize=(4.2 * len(labels), 3.8))
    for i, label in enumerate(labels):
        ax, table = fig.add_subplot(1, len(labels), i + 1), tables[label][system]
        for name, curve in table["curves"].items():
            ax.plot(curve["coverage"], curve["risk"], lw=1.2, label=f"{name} ({table['aurc'][name]:.3f})")
        ax.axhline(table["random"], color="0.6", lw=1, ls="--", label=f"mean risk ({table['random']:.3f})")
        ax.set(xlabel="coverage (share of queries answered)", ylabel="risk (1 - nDCG@10)", xlim=(0, 1))
        ax.set_title(f"{system}: {os.path.basename(str(label).rstrip('/'))} (AURC optimal {table['optimal']:.3f})")
        ax.title.set_fontsize(8)
        ax.legend(fontsize=7)
    fig.tight_layout()
    if path is not None:
        save_figure(fig, path)
    return fig


def depth_curves_plot(rows: list[Mapping], path: str | os.PathLike | None = None) -> Figure:
    """One panel per collection: nDCG@10 against the mean number of re-ranked pairs per query, fixed-k as a line and
    every per-query rule as points (a rule above the line beats fixed-k at its cost); saved at ``path`` if given."""
    frame = pd.DataFrame(rows)
    labels = list(dict.fromkeys(frame["collection"]))
    fig = Figure(figsize=(4.6 * len(labels), 4.0))
    for i, label in enumerate(labels):
        ax, g = fig.add_subplot(1, len(labels), i + 1), frame[frame["collection"] == label]
        fixed = g[g["rule"] == "fixed"].sort_values("mean_pairs")
        ax.plot(fixed["mean_pairs"], fixed["nDCG@10"], color="0.3", marker="o", ms=3, label="fixed-k")
        for rule, r in g[g["rule"] != "fixed"].groupby("rule", sort=False):
            ax.plot(r["mean_pairs"], r["nDCG@10"], marker="x", ls="", ms=6, label=str(rule))
        ax.set(xlabel="re-ranked pairs per query (mean)", ylabel="nDCG@10")
        ax.set_title(os.path.basename(str(label).rstrip("/")), fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    if path is not None:
        save_figure(fig, path)
    return fig
