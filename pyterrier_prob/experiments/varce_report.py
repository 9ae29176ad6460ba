"""The ``pyterrier-prob varce`` report: Markdown generated from what the run did (its tables and ``summary.json``);
a section appears only when the run made what it reports."""

from __future__ import annotations

import math
from typing import Any

import pandas as pd

from pyterrier_prob.experiments.harness import markdown_table, measure_cell, p_mark
from pyterrier_prob.experiments.report import MISSING, cell
from pyterrier_prob.varce.noise import NOISE_DESCRIPTIONS

__all__ = ["distill_markdown", "markdown"]


def _p(p: float | None) -> str:
    return "" if p is None else f"{p:.2g}"


def markdown(tables: dict[str, pd.DataFrame], summary: dict[str, Any], baseline: str) -> str:
    """The job's tables as Markdown (what goes into the README)."""
    parts = [_training(summary), _effectiveness(tables["results"], summary), _dev_choices(summary)]
    parts += [_uncertainty(tables["uncertainty"]), _risk(tables["risk"]), _hard(tables["hard_queries"])]
    parts += [_robustness(tables["robustness"], baseline), _scoring(summary)]
    return "\n\n".join(p for p in parts if p) + "\n"


def _training(summary: dict[str, Any]) -> str:
    recipe = summary["recipe"]  # the Recipe's own description heads the report when a model trained under it
    lines = [recipe["training"] if summary["fine_tuned"] else f"Recipe: {recipe['description']}", ""]
    lines.append(f"`*`: p < 0.05, {summary['significance']}.")
    rows = summary.get("training_rows")
    if rows:
        lines += [
            "",
            f"Training rows: {rows['rows']} from {rows['source']} ({rows['queries']} queries; 1 judged-relevant : "
            f"{rows['negatives_per_group']} negatives, {rows['negatives']}, from {rows.get('negatives_from')}; "
            f"{rows['random_negatives_filled_in']} random negatives filled in; positives: {rows.get('positives')}, "
            f"{rows.get('positives_available')} of {rows.get('relevant_judged')} judged-relevant).",
        ]
    losses = summary.get("training_loss_first_last") or {}
    if losses:
        pairs = ", ".join(f"{n} {a:.3f} -> {b:.3f}" for n, (a, b) in losses.items())
        lines += ["", f"Training loss (first -> last step): {pairs}"]
    return "\n".join(lines)


def _effectiveness(results: pd.DataFrame, summary: dict[str, Any]) -> str:
    cells = {m: [measure_cell(r, m) for _, r in results.iterrows()] for m in ("nDCG@10", "RR@10")}
    table = results[["collection", "queries", "depth", "name"]].rename(columns={"name": "system"}).assign(**cells)
    lines = ["BM25 candidates re-ranked (nDCG@10, RR@10 = MRR@10):", "", markdown_table(table)]
    rerank = pd.DataFrame(summary.get("rerank_rows") or [], dtype=object)
    if not rerank.empty:
        p = {f"p vs {b}": [_p(v) for v in rerank[f"p_vs_{b.replace('BM25', 'bm25')}"]] for b in ("BM25", "CE")}
        lines += [
            "",
            "nDCG@10 with paired t-tests (scipy.stats.ttest_rel over the queries) against BM25 and against CE, at each "
            "re-ranking depth (the shallower depths re-rank BM25's top k with the same scores):",
            "",
            markdown_table(rerank[["collection", "depth", "queries", "system", "nDCG@10"]].assign(**p)),
        ]
    return "\n".join(lines)


def _dev(chosen: dict[str, Any]) -> str:
    return next(iter(chosen.values()))["dev"]


def _values(choice: dict[str, Any]) -> str:
    return "{" + ", ".join(f"{x:g}: {v:.4f}" for x, v in choice["dev_nDCG@10"].items()) + "}"


def _dev_choices(summary: dict[str, Any]) -> str:
    lines = []
    curves = summary.get("dev_curves") or {}
    if curves:
        lines += ["Learning curves (dev nDCG@10 against steps; the model kept is the one at its best dev point):", ""]
        for n, c in curves.items():
            pts = ", ".join(f"{p['step']}: {p['dev']:.4f}" for p in c.get("points", []))
            best = c.get("best") or {}
            lines.append(f"- {n}: {pts} (best: step {best.get('step')}, {best.get('dev', math.nan):.4f})")
    inter = summary.get("interpolation_chosen_on_dev") or {}
    if inter:
        head = f"Interpolation with BM25 (alpha * z(E[s]) + (1 - alpha) * z(BM25)), alpha chosen on {_dev(inter)}:"
        lines += ["", head, ""]
        for n, c in inter.items():
            lines.append(f"- {n}: dev nDCG@10 by alpha {_values(c)} -> alpha = {c['alpha']:g} (system {n}+BM25)")
    chosen = summary.get("risk_chosen_on_dev") or {}
    if chosen:
        lines += ["", f"Risk-aware ranking with lambda chosen on {_dev(chosen)} (E[s] - lambda * std[s]):", ""]
        for n, c in chosen.items():
            lines.append(
                f"- {n}: dev nDCG@10 by lambda {_values(c)} -> lambda = {c['lambda']:g}; test nDCG@10 "
                f"{c.get('test_nDCG@10', math.nan):.4f} vs {c.get('test_nDCG@10_at_lambda_0', math.nan):.4f} at "
                f"lambda = 0 (p = {c.get('p_vs_lambda_0', math.nan):.2g})"
            )
    return "\n".join(lines).strip()


_UNCERTAINTY_COLUMNS = ["collection", "name", "n_queries", "std 5/50/95%", "std_within_query_cv_median"]
_UNCERTAINTY_COLUMNS += ["std_between_queries_sd", "std_within_query_sd_mean", "std_between_query_variance_share"]
_UNCERTAINTY_COLUMNS += ["rho(std, nDCG@10)", "rho(mean, nDCG@10)", "rho_pairs_std_vs_mean"]
_UNCERTAINTY_NAMES = {"std_within_query_cv_median": "CV in query", "std_between_queries_sd": "SD between queries"}
_UNCERTAINTY_NAMES |= {"std_within_query_sd_mean": "SD within query", "rho_pairs_std_vs_mean": "rho(std, mean) pairs"}
_UNCERTAINTY_NAMES["std_between_query_variance_share"] = "between-query share"


def _rho(u: pd.DataFrame, of: str) -> list[str]:
    return [f"{r:.3f}{p_mark(p)}" for r, p in zip(u[f"rho_top10_{of}_vs_nDCG@10"], u[f"p_top10_{of}"])]


def _uncertainty(u: pd.DataFrame) -> str:
    if u.empty:
        return ""
    q = [f"{a:.5f} / {b:.5f} / {c:.5f}" for a, b, c in zip(u["std_q05"], u["std_q50"], u["std_q95"])]
    u = u.assign(**{"std 5/50/95%": q, "rho(std, nDCG@10)": _rho(u, "std"), "rho(mean, nDCG@10)": _rho(u, "mean")})
    table = markdown_table(u[_UNCERTAINTY_COLUMNS].rename(columns=_UNCERTAINTY_NAMES), floatfmt=".3g")
    return (
        "Is the uncertainty informative? std[s] (Eq. 23): its 5/50/95% quantiles over the re-ranked pairs and median "
        "within-query coefficient of variation; Spearman rho of each query's mean std[s] over its top 10 with its "
        "nDCG@10 (and of its mean E[s], for reference); rho of std[s] with E[s] over the pairs.\n\n" + table
    )


def _risk(risk: pd.DataFrame) -> str:
    if risk.empty:
        return ""
    cells = [f"{measure_cell(r, 'nDCG@10')} ({r['changed_top10']:.2f})" for _, r in risk.iterrows()]
    table = risk.assign(cell=cells).pivot_table("cell", ["collection", "model"], "name", aggfunc="first", sort=False)
    return (
        "Risk-aware ranking E[s] - lambda * std[s]: nDCG@10 (`*` vs lambda = 0; share of queries whose top 10 changed)"
        "\n\n" + markdown_table(table.reset_index().rename_axis(columns=None))
    )


def _hard(hard: pd.DataFrame) -> str:
    cols = ["collection", "hard_under", "name", "n_hard", "nDCG@10", "nDCG@10 hard", "RR@10", "RR@10 hard"]
    return (
        "Hard queries (Table 8): the bottom 50% by nDCG@10 under the named system; %no = % of queries with no "
        "relevant document in the top 10.\n\n" + markdown_table(hard[[*cols, "%no", "%no hard"]])
    )


def _robustness(robustness: pd.DataFrame, baseline: str) -> str:
    if robustness.empty:
        return ""
    first = robustness.drop_duplicates("perturbation").set_index("perturbation")
    n = int(first["queries"].iloc[0])
    cells = [measure_cell(r, "nDCG@10") for _, r in robustness.iterrows()]
    table = robustness.assign(cell=cells).pivot_table("cell", "name", "perturbation", aggfunc="first", sort=False)
    table.loc["changed queries"] = [f"{first.loc[k, 'changed_queries']}/{n}" for k in table.columns]
    return (
        f"Robustness (Table 4): nDCG@10 on {n} seeded test queries, BM25 candidates of the (perturbed) query; `*` vs "
        f"{baseline} under the same perturbation; the last row counts the changed queries. One word per query is "
        "perturbed: "
        + "; ".join(f"{k} {NOISE_DESCRIPTIONS[k]}" for k in first.index if k != "clean")
        + ".\n\n"
        + markdown_table(table.rename_axis(index="system", columns=None).reset_index())
    )


def _scoring(summary: dict[str, Any]) -> str:
    rates = ", ".join(
        f"{k} {v['pairs_scored']} pairs" + (f" at {v['pairs_per_s']:.0f} pairs/s" if v["pairs_per_s"] else "")
        for k, v in summary["scoring"].items()
    )
    through = summary["recipe"].get("pairs_through_backbone")
    if through is None:
        return f"Scoring (each distinct pair once): {rates}."
    return (
        f"Scoring (each distinct pair once): {rates}; the heads read cached backbone features ({through} pairs, "
        "training and test, through the backbone once), so these rates leave the backbone out."
    )


def distill_markdown(summary: dict[str, Any]) -> str:
    """The distillation run's report (``varce --teacher``): the re-ranking table at each collection's depth (nDCG@10,
    p vs BM25 / CE), the evaluated collections, the teacher's choice on dev, the students' ECE, the attention between
    the texts in their joint layers, how far each ranker follows BM25 and the selective-prediction AURCs."""
    rows = pd.DataFrame(summary["rows"])
    evaluated = summary["evaluated"]
    rows = rows[[d == evaluated[c]["depth"] for c, d in zip(rows["collection"], rows["depth"])]].copy()
    cells = zip(rows["nDCG@10"], rows["p_vs_bm25"], rows["p_vs_CE"])
    rows["cell"] = [f"{v:.4f} ({cell(a, '.2g')} / {cell(b, '.2g')})" for v, a, b in cells]
    names = zip(rows["collection"], rows["queries"])
    rows["collection"] = [f"{c} ({n} q., top {evaluated[c]['depth']})" for c, n in names]
    table = rows.pivot_table(index="system", columns="collection", values="cell", aggfunc="first")
    table = table.reindex(index=list(dict.fromkeys(rows["system"])), columns=list(dict.fromkeys(rows["collection"])))
    teacher = summary["teacher"]
    shot = [c for c, e in evaluated.items() if e["zero_shot"]]
    text = [
        "BM25's top k re-ranked, nDCG@10 (p vs BM25 / p vs CE, paired t-tests over all queries"
        + (f"; zero-shot: {', '.join(shot)}" if shot else "") + "):",
        "",
        markdown_table(table.fillna(MISSING).reset_index()),
        "",
        f"Teacher: {teacher['model']} fused with BM25 at alpha {teacher['alpha']} (chosen on dev: "
        + ", ".join(f"{a}: {v:.4f}" for a, v in teacher["dev_nDCG@10_by_alpha"].items())
        + ").",
    ]  # fmt: skip
    if summary.get("calibration"):
        text += ["", "Expected calibration error on the test pairs (Platt map fitted on dev pairs):", ""]
        for name, c in summary["calibration"].items():
            extra = f" (without std[s]: {c['ece_without_std']:.4f})" if "ece_without_std" in c else ""
            text.append(f"- {name}: ECE {c['ece']:.4f}{extra}")
            if "ranking" in c:  # how often the higher-scored of two top-10 documents is the more relevant, calibrated
                r = c["ranking"]
                extra = f" (without std[s]: {r['rce_without_std']:.4f})" if "rce_without_std" in r else ""
                text[-1] += f"; ranking calibration error {r['rce']:.4f} over {r['pairs']} top-10 pairs{extra}"
    text += _attention_lines(summary) + _lexical_lines(summary) + _aurc_lines(summary)
    return "\n".join(text) + "\n"


def _lexical_lines(summary: dict[str, Any]) -> list[str]:
    """How far each ranker follows BM25 and how far the teacher's bi-encoder, per collection (least-squares weights of
    its per-query z-scores on theirs, ``distill.lexical_share``)."""
    shares = summary.get("lexical_share") or {}
    if not shares:
        return []
    labels = list(shares)
    text = [
        "",
        "What each ranker follows: the BM25 share |w_bm25| / (|w_bm25| + |w_dense|) of the least-squares weights of "
        "its per-query z-scores on BM25's and the teacher bi-encoder's (R^2 in brackets), on the re-ranked pairs:",
        "",
        "| ranker | " + " | ".join(labels) + " |",
        "|---|" + "---|" * len(labels),
    ]
    names = list(dict.fromkeys(n for v in shares.values() for n in v))
    for name in names:
        got = [shares[c].get(name) for c in labels]
        cells = [MISSING if g is None else f"{cell(g['bm25_share'], '.3f')} ({cell(g['r2'], '.2f')})" for g in got]
        text.append(f"| {name} | " + " | ".join(cells) + " |")
    return text


def _attention_lines(summary: dict[str, Any]) -> list[str]:
    """The attention mass between the texts per joint layer, as built and as kept, beside uniform attention's."""
    mass = summary.get("cross_attention_mass") or {}
    if not mass:
        return []
    text = [
        "",
        f"Attention between the two texts in the students' {summary.get('joint_layers')} joint layer(s), on "
        "dev pairs: mass a query token puts on the document / a document token on the query, at step 0 -> the kept "
        "step (uniform attention's share):",
        "",
    ]
    for name, m in mass.items():
        cells = [
            f"layer {a['layer']}: {a['query_to_document']:.3f} -> {b['query_to_document']:.3f} "
            f"({a['uniform_query_to_document']:.3f}) / {a['document_to_query']:.3f} -> {b['document_to_query']:.3f} "
            f"({a['uniform_document_to_query']:.3f})"
            for a, b in zip(m["step_0"], m["kept"])
        ]
        text.append(f"- {name} ({m['pairs']} pairs): " + "; ".join(cells))
        if term := m.get("joint_term"):
            text.append(
                f"  - its score at the kept step: the joint layers' term makes {term['joint_share']:.1%} of its spread "
                f"over these pairs (std {term['joint_std']:.3f} of {term['score_std']:.3f}; the bi-encoder path "
                f"{term['bi_encoder_std']:.3f}); at step 0 it made none"
            )
    return text


def _aurc_lines(summary: dict[str, Any]) -> list[str]:
    """Selective prediction per collection: each student's AURC per confidence (lower is better)."""
    tables = summary.get("aurc") or {}
    text = []
    for label, systems in tables.items():
        frame = pd.DataFrame({s: t["aurc"] for s, t in systems.items()}).T
        first = next(iter(systems.values()))
        frame["best order"], frame["mean risk"] = [t["optimal"] for t in systems.values()], first["random"]
        text += [
            "",
            f"Selective prediction on {label} ({first['queries']} queries; risk 1 - nDCG@10): AURC per confidence "
            "(lower is better):",
            "",
            markdown_table(frame.map(lambda v: cell(v, ".4f")).rename_axis("system").reset_index()),
        ]
    return text
