"""The Mixture-of-Logits experiment (``pyterrier-prob mol``): MoL against the dot-product bi-encoder, same
backbone, same pairs, same budget.

Ding & Zhai, *Retrieval with Learned Similarities* (WWW'25, ``shared/papers/mixture-of-logits.txt``). MoL scores a
query q and a document x with the learned similarity

    phi(q, x) = sum_{pq, px} pi_{pq,px}(q, x) <f_pq(q) / ||f_pq(q)||, g_px(x) / ||g_px(x)||>          (Eqs. 1-2)

over the P = P_q x P_x pairs of query and document component embeddings, with a learned gate pi (a softmax over
the P pairs, App. A.3), trained with the sampled softmax over phi plus alpha * L_MI, the load-balancing loss
L_MI = -H(p) + H(p | (q, x)) (Eqs. 3-4). Collections, training, indexing, ``pt.Experiment`` and the report come
from :mod:`pyterrier_prob.experiments.harness`. The protocol:

1. from the same base model (``--model``, default the packaged all-MiniLM-L6-v2), fine-tune with the same
   (query, relevant document) pairs of the train split, optimiser steps, batch size, encoder learning rate, seed,
   batch order and ``max_seq_length``:

   * ``bi-encoder``: the model itself (mean pooling, cosine; under the frozen recipe with a
     :class:`~st_extensions.modules.LinearAdapter`) with
     :class:`~st_extensions.losses.MaskedMultipleNegativesRankingLoss` (scale 20);
   * ``MoL``: :func:`st_extensions.build_mol_model` on the same weights, trained with
     :class:`~st_extensions.losses.MoLLoss` (Eq. 4, alpha = 0.001, scale 20);
   * ``MoL (no L_MI)`` (``--mi-ablation``): the same with alpha = 0, the paper's "abl. L_MI" rows (Table 4);

   the base model as it is (``base model (no fine-tuning)``) is a reference row. By default (``--recipe frozen``)
   the encoder is frozen and only the new modules train, on cached encoder outputs, on query-balanced batches with
   judged-relevant in-batch negatives masked: MoL then makes its P_q = P_x = 4 components with linear heads on the
   pooled embedding (``component_source="heads"``) and gates them with a SiLU MLP over the P dot products. With
   ``--recipe full`` and ``--component-source tokens`` it uses the paper's construction for text (App. A.2): P_q +
   P_x aggregation tokens after ``[CLS]`` read by parameterised pooling (they take P_q + P_x of the
   ``max_seq_length`` positions, so MoL sees fewer text tokens than the bi-encoder). The new MoL parameters
   (:data:`HEAD_PARAMS`) train at ``MixtureOfLogits.learning_rate`` (or ``--head-lr``), the encoder at ``--lr``;
2. encode the test collection (``--test-dataset``: zero-shot transfer) with each model: a
   :class:`~pyterrier_prob.DenseIndex` for the dense ones, a :class:`~pyterrier_prob.MoLIndex` for MoL;
3. retrieve the top ``--k`` documents of the whole collection for every test query: ``TopKRetriever`` (cosine)
   or ``MoLRetriever(method="brute_force")`` (phi for every document, Sec. 3.1), and compare the systems in
   ``pt.Experiment`` with nDCG@10 and R@k, paired t-tests against the bi-encoder;
4. summarise the gate pi(q, x) of each MoL model on (test query, retrieved document) pairs and on (test query,
   judged-relevant document) pairs: the mean conditional entropy H(pi | q, x), the entropy H(p) of the average gate
   (the load on the P pairs) and the mutual information H(p) - H(pi | q, x) = -L_MI (Eq. 3), in nats.

Nothing is calibrated, so every query of the test split is reported (also when the collection has no dev split).
With no train split or ``--steps 0`` nothing is fine-tuned: ``--model`` is evaluated as a bi-encoder and, when it
is a saved MoL model (:func:`st_extensions.find_mol`), also with its MoL similarity (then the significance baseline
is the bi-encoder reading of the same model). A saved MoL model as ``--model`` with ``--steps`` > 0: the MoL
systems continue training it (its own P_q, P_x, d_P; ``--pq``/``--px``/``--component-dim``/``--component-source``
do not apply), the dense systems use its pooled embedding.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

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
    "HEAD_PARAMS",
    "MolJobConfig",
    "add_arguments",
    "config_from_args",
    "gate_statistics",
    "run",
    "run_mol_job",
]

DESCRIPTION = (
    "Mixture-of-Logits (Ding & Zhai, Retrieval with Learned Similarities): fine-tune a dot-product bi-encoder "
    "(MNRL) and a MoL model (MoLLoss, Eq. 4) from the same base with the same budget, index the test collection "
    "with each, retrieve the top k of the whole collection (MoL by brute force), compare them with pt.Experiment "
    "(nDCG@10, R@k, paired t-tests against the bi-encoder) and summarise the MoL gate (H(pi|q,x), H(p), MI)."
)

REFERENCE = "base model (no fine-tuning)"
BASELINE = "bi-encoder"
MOL = "MoL"
MOL_NO_MI = "MoL (no L_MI)"
MOL_UNTRAINED = "MoL (no fine-tuning)"
"""System names in the result tables; significance is tested against ``BASELINE`` (``REFERENCE`` when nothing is
fine-tuned)."""

#: Parameters of the MixtureOfLogits module (pooling, projections or heads, gate): the ones ``--head-lr`` sets.
HEAD_PARAMS = r"(^|\.)(query_pool|doc_pool|query_proj|doc_proj|query_heads|doc_heads|gate_net)\."

ENCODE_BATCH = 64


@dataclass
class MolJobConfig(CommonConfig):
    """Settings of :func:`run_mol_job` (the ``pyterrier-prob mol`` options); the shared ones are
    :class:`~pyterrier_prob.experiments.harness.CommonConfig`'s.

    Attributes:
        alpha: weight of L_MI in MoLLoss (Eq. 4) for the ``MoL`` row.
        scale: softmax scale (1 / temperature) of both losses.
        head_lr: learning rate of the new MoL parameters (:data:`HEAD_PARAMS`); None: the rate the module declares,
            ``MixtureOfLogits.learning_rate`` (chosen on nfcorpus dev, ``benchmarks/recipe_search.py``).
        pq, px: P_q and P_x, the query and document components.
        component_dim: d_P (None: the encoder's hidden size for ``"tokens"``, its embedding size for ``"heads"``).
        component_source: ``"heads"`` (linear heads on the pooled embedding; the default, what the frozen recipe
            trains) or ``"tokens"`` (aggregation tokens, App. A.2; needs ``--recipe full``) on the pooled
            embedding).
        head_init: ``"heads"`` only: ``"identity"`` (each component starts as the pooled embedding, so the untrained
            MoL scores as the base model: it starts where the dot-product baseline starts) or ``"orthogonal"``.
        k: documents retrieved per query (R@k is measured at this depth).
        mi_ablation: also train the alpha = 0 model (``MoL (no L_MI)``).
    """

    output: str = "outputs/mol"
    alpha: float = 0.001
    scale: float = 20.0
    head_lr: float | None = None
    pq: int = 4
    px: int = 4
    component_dim: int | None = None
    component_source: str = "heads"
    head_init: str = "identity"
    k: int = 100
    mi_ablation: bool = False

    def check(self) -> None:
        """Raise ``ValueError`` naming the first setting out of range."""
        super().check()
        if not (math.isfinite(self.alpha) and self.alpha >= 0):
            raise ValueError(f"--alpha must be finite and >= 0, got {self.alpha}")
        if not (math.isfinite(self.scale) and self.scale > 0):
            raise ValueError(f"--scale must be > 0, got {self.scale}")
        if self.head_lr is not None and not (math.isfinite(self.head_lr) and self.head_lr > 0):
            raise ValueError(f"--head-lr must be > 0, got {self.head_lr}")
        if self.pq < 1 or self.px < 1:
            raise ValueError(f"--pq and --px must be >= 1, got {self.pq} and {self.px}")
        if self.component_dim is not None and self.component_dim < 1:
            raise ValueError(f"--component-dim must be >= 1, got {self.component_dim}")
        if self.component_source not in ("tokens", "heads"):
            raise ValueError(f"--component-source must be 'tokens' or 'heads', got {self.component_source!r}")
        if self.head_init not in ("identity", "orthogonal"):
            raise ValueError(f"--head-init must be 'identity' or 'orthogonal', got {self.head_init!r}")
        if self.component_source == "tokens" and self.recipe == "frozen" and self.steps:
            raise ValueError(
                "--component-source tokens reads the encoder's token outputs, which the frozen recipe does not "
                "cache: use --component-source heads or --recipe full"
            )
        if self.component_source == "tokens" and self.pq + self.px + 2 > self.max_seq_length:
            raise ValueError(
                f"--pq {self.pq} + --px {self.px} aggregation tokens (plus [CLS] and [SEP]) do not fit in "
                f"--max-seq-length {self.max_seq_length}"
            )
        if self.k < 10:
            raise ValueError(f"--k must be >= 10 (nDCG@10 is measured), got {self.k}")


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The ``pyterrier-prob mol`` options."""
    d = MolJobConfig()
    add_common_arguments(ap, d)
    g = ap.add_argument_group("Mixture-of-Logits")
    g.add_argument("--alpha", type=float, default=d.alpha, help="weight of L_MI (Eq. 3) in MoLLoss for the MoL row")
    g.add_argument("--scale", type=float, default=d.scale, help="softmax scale (1/temperature) of both losses")
    g.add_argument(
        "--head-lr",
        type=float,
        default=d.head_lr,
        help="learning rate of the new MoL parameters (default: the rate MixtureOfLogits declares)",
    )
    g.add_argument("--pq", type=int, default=d.pq, help="P_q, query component embeddings")
    g.add_argument("--px", type=int, default=d.px, help="P_x, document component embeddings")
    g.add_argument("--component-dim", type=int, default=d.component_dim, help="d_P (None: the encoder's hidden size)")
    g.add_argument(
        "--component-source",
        choices=["tokens", "heads"],
        default=d.component_source,
        help="aggregation tokens read by parameterised pooling (App. A.2) or linear heads on the pooled embedding",
    )
    g.add_argument(
        "--head-init",
        choices=["identity", "orthogonal"],
        default=d.head_init,
        help="heads: start every component at the pooled embedding (identity + noise; needs the default d_P) or "
        "at independent orthogonal maps",
    )
    g.add_argument("--k", type=int, default=d.k, help="documents retrieved per query (R@k)")
    g.add_argument(
        "--mi-ablation", action="store_true", help="also train MoL with alpha = 0 (the paper's 'abl. L_MI' row)"
    )


def config_from_args(a: argparse.Namespace) -> MolJobConfig:
    return MolJobConfig(
        **common_from_args(a),
        alpha=a.alpha,
        scale=a.scale,
        head_lr=a.head_lr,
        pq=a.pq,
        px=a.px,
        component_dim=a.component_dim,
        component_source=a.component_source,
        head_init=a.head_init,
        k=a.k,
        mi_ablation=a.mi_ablation,
    )


def run(cfg: MolJobConfig) -> dict[str, Any]:
    return run_mol_job(cfg)


# --------------------------------------------------------------------------------------------------------------
# gate statistics
# --------------------------------------------------------------------------------------------------------------


def _entropy(p: np.ndarray) -> np.ndarray:
    return -(p * np.log(np.clip(p, 1e-12, None))).sum(-1)


def gate_statistics(
    mol: Any,
    q_comps: np.ndarray,
    x_comps: np.ndarray,
    qi: np.ndarray,
    docids: np.ndarray,
    q_feats: np.ndarray | None = None,
    x_feats: np.ndarray | None = None,
    chunk: int = 4096,
) -> dict[str, Any]:
    """The gate pi(q, x) (App. A.3) over the (query ``qi[i]``, document ``docids[i]``) pairs, entropies in nats.

    With every pair equally likely, ``H(pi|q,x)`` is the mean entropy of the per-pair gates, ``H(p)`` the entropy of
    the average gate p = mean pi (the load on the P = P_q x P_x component pairs) and their difference the mutual
    information I(p; (q, x)) = -L_MI (Eq. 3): L_MI asks for a large H(p) (balanced load) and a small H(pi|q,x)
    (sparse gates). A uniform gate has H(pi|q,x) = H(p) = log P and MI = 0.

    Args:
        mol: the model's :class:`~st_extensions.modules.MixtureOfLogits` (:func:`st_extensions.find_mol`).
        q_comps: ``(Q, P_q, d_P)`` query components; ``qi`` indexes its rows.
        x_comps: ``(N, P_x, d_P)`` document components (a :meth:`MoLIndex.components` memmap); ``docids`` its rows.
        q_feats, x_feats: the gate's side features (``(Q, F)``, ``(N, F)``) when ``mol.gate_features``.
        chunk: pairs per gate evaluation.

    Returns:
        ``pairs``, ``P``, ``log_P``, ``H_pi_given_qx``, ``H_p``, ``MI``, ``effective_pairs_exp_H_p``,
        ``mean_effective_pairs_exp_H_pi``, ``mean_max_pi``, and the ``(P_q, P_x)`` matrices ``usage_mean_pi``
        (p) and ``usage_argmax_share`` (how often each pair has the largest weight).
    """
    import torch

    P = mol.num_query_components * mol.num_doc_components
    if len(qi) == 0:
        return {"pairs": 0, "P": P, "log_P": round(math.log(P), 4)}
    gates = []
    with torch.inference_mode():
        for a in range(0, len(qi), chunk):
            q = torch.from_numpy(np.asarray(q_comps[qi[a : a + chunk]], dtype=np.float32))
            uniq, inv = np.unique(docids[a : a + chunk], return_inverse=True)  # sorted reads from the memmap
            inv = torch.from_numpy(inv.reshape(-1))
            x = torch.from_numpy(np.asarray(x_comps[uniq], dtype=np.float32))[inv]
            qf = xf = None
            if getattr(mol, "gate_features", False):
                qf = torch.from_numpy(np.asarray(q_feats[qi[a : a + chunk]], dtype=np.float32))
                xf = torch.from_numpy(np.asarray(x_feats[uniq], dtype=np.float32))[inv][:, None]
            gates.append(mol.gate(q, x[:, None], qf, xf).reshape(len(q), -1).float().cpu().numpy())
    pi = np.concatenate(gates)
    usage = pi.mean(0)
    h_cond, h_marg = float(_entropy(pi).mean()), float(_entropy(usage))
    argmax = np.bincount(pi.argmax(1), minlength=P) / len(pi)
    return {
        "pairs": int(len(pi)),
        "P": P,
        "log_P": round(math.log(P), 4),
        "H_pi_given_qx": round(h_cond, 4),
        "H_p": round(h_marg, 4),
        "MI": round(h_marg - h_cond, 4) + 0.0,  # >= 0 (Jensen); + 0.0 turns a rounded -0.0 into 0.0
        "effective_pairs_exp_H_p": round(math.exp(h_marg), 3),
        "mean_effective_pairs_exp_H_pi": round(float(np.exp(_entropy(pi)).mean()), 3),
        "mean_max_pi": round(float(pi.max(1).mean()), 4),
        "usage_mean_pi": np.round(usage.reshape(mol.num_query_components, -1), 4).tolist(),
        "usage_argmax_share": np.round(argmax.reshape(mol.num_query_components, -1), 4).tolist(),
    }


# --------------------------------------------------------------------------------------------------------------
# the job
# --------------------------------------------------------------------------------------------------------------


@dataclass
class _System:
    """One row of the result table: how its model is made and scored."""

    name: str
    model_name: str  # under output/models (and the index name)
    kind: str  # "dense" or "mol"
    build: Callable[[], Any]
    loss: Callable[[Any], Any] | None  # None: not fine-tuned
    alpha: float | None = None
    mapping: dict[str, float] | None = None


def _has_mol(model: Any) -> bool:
    from st_extensions import find_mol

    try:
        find_mol(model)
    except ValueError:
        return False
    return True


def _loss_summary(losses: list[float]) -> dict[str, Any]:
    return {
        "first": round(losses[0], 4),
        "last": round(losses[-1], 4),
        "mean_first_10": round(float(np.mean(losses[:10])), 4),
        "mean_last_10": round(float(np.mean(losses[-10:])), 4),
        "steps_logged": len(losses),
    }


def _systems(cfg: MolJobConfig, data: Data, given_is_mol: bool) -> list[_System]:
    """The systems of this run, in table order (module docstring)."""
    from pyterrier_prob.data import judged_pairs
    from st_extensions import build_mol_model, default_model_path, load_model
    from st_extensions.frozen import build_adapter_model
    from st_extensions.losses import MaskedMultipleNegativesRankingLoss, MoLLoss

    judged_cache: list[Any] = []

    def judged() -> Any:
        if not judged_cache:
            judged_cache.append(judged_pairs(data.train_collection, data.train))
        return judged_cache[0]

    def base() -> Any:
        return load_model(cfg.model or default_model_path(), device="cpu")

    def build_dense() -> Any:  # frozen recipe: the same LinearAdapter on the cached encoder as a dense baseline
        return build_adapter_model(base()) if cfg.recipe == "frozen" else base()

    def build_mol() -> Any:
        model = base()
        if given_is_mol:
            return model  # a saved MoL model: continue training it
        model.max_seq_length = cfg.max_seq_length  # the position pooling covers the inputs the model will see
        return build_mol_model(
            model,
            num_query_components=cfg.pq,
            num_doc_components=cfg.px,
            component_dim=cfg.component_dim,
            component_source=cfg.component_source,
            head_init=cfg.head_init,
            seed=cfg.seed,
            device="cpu",
        )

    ref = "untrained"  # the harness reuses its index only for the same --model and --max-seq-length
    systems = [_System(REFERENCE, ref, "dense", base, None)]
    if data.train is None:
        if given_is_mol:
            systems.append(_System(MOL_UNTRAINED, ref + "-mol", "mol", base, None))
        return systems
    mapping = {HEAD_PARAMS: cfg.head_lr} if cfg.head_lr is not None else None
    systems.append(
        _System(
            BASELINE,
            "bi-encoder",
            "dense",
            build_dense,
            lambda m: MaskedMultipleNegativesRankingLoss(m, scale=cfg.scale, judged=judged()),
        )
    )
    alphas = [(MOL, "mol", cfg.alpha)] + ([(MOL_NO_MI, "mol-no-lmi", 0.0)] if cfg.mi_ablation else [])
    for name, model_name, alpha in alphas:
        systems.append(
            _System(
                name,
                model_name,
                "mol",
                build_mol,
                lambda m, a=alpha: MoLLoss(m, alpha=a, scale=cfg.scale, judged=judged()),
                alpha=alpha,
                mapping=mapping,
            )
        )
    return systems


def run_mol_job(cfg: MolJobConfig) -> dict[str, Any]:
    """Run the Mixture-of-Logits experiment (module docstring) and write its outputs to ``cfg.output``.

    Writes ``results.csv`` (the pt.Experiment table: nDCG@10, R@k, paired t-tests against the bi-encoder),
    ``gate.csv`` (gate statistics per MoL system and pair set), ``training.csv`` (losses), ``summary.json`` and
    ``results.md``; models under ``models/``, indexes under ``indexes/``.

    Returns:
        ``{"experiment": frame, "gate": frame, "training": frame, "summary": dict}``.
    """
    import gc

    from ir_measures import R, nDCG

    from pyterrier_prob.data import training_pairs
    from pyterrier_prob.mol import MoLEncoder, MoLRetriever
    from pyterrier_prob.pebr import ProbBiEncoder, TopKRetriever
    from st_extensions import default_model_path, find_mol, load_model

    cfg.check()
    h = Harness("mol", cfg)
    data = h.load_data(calibrate=False)  # nothing is calibrated: every test query is reported
    given_is_mol = bool(cfg.model) and _has_mol(load_model(cfg.model, device="cpu"))
    if given_is_mol:
        data.notes.append(f"--model {cfg.model} is a MoL model: the dense rows read its pooled embedding")
    systems = _systems(cfg, data, given_is_mol)
    if len(systems) == 1:
        data.notes.append(
            f"nothing to fine-tune and {cfg.model or 'the base model'} has no MoL head: only its dense row "
            "(pass a saved MoL model as --model to evaluate its MoL similarity too)"
        )
    names = [s.name for s in systems]
    baseline = BASELINE if BASELINE in names else (REFERENCE if len(names) > 1 else None)
    topics, qrels = data.test_topics, data.test_qrels
    coll = data.test_collection

    pairs_cache: list[Any] = []

    def pairs() -> Any:  # the same pairs (and, through fine_tune's seed, the same batches) for every system
        if not pairs_cache:
            pairs_cache.append(training_pairs(data.train_collection, data.train, seed=cfg.seed))
        return pairs_cache[0]

    runs: dict[str, pd.DataFrame] = {}
    info: dict[str, dict[str, Any]] = {}
    gate: dict[str, dict[str, Any]] = {}
    for s in systems:
        entry: dict[str, Any] = {"similarity": "MoL (Eq. 1-2)" if s.kind == "mol" else "cosine"}
        settings = {
            "system": s.name,
            "train": f"{data.train_collection.name}/{data.train}",
            "scale": cfg.scale,
            "alpha": s.alpha,
            "mol": None
            if s.kind == "dense"
            else {"pq": cfg.pq, "px": cfg.px, "component_dim": cfg.component_dim, "source": cfg.component_source},
        }
        train = pairs if (s.loss is not None and data.train) else None
        model, losses = h.train(
            s.model_name,
            s.build,
            s.loss or (lambda m: None),
            train,
            learning_rate_mapping=s.mapping,
            settings=settings,
        )
        if s.loss is not None:
            entry["loss"] = "MoLLoss" if s.kind == "mol" else "MaskedMultipleNegativesRankingLoss"
            entry["recipe"] = cfg.recipe
            entry.update(scale=cfg.scale, **({"alpha": s.alpha} if s.alpha is not None else {}))
            if s.mapping:
                entry["learning_rate"] = {"encoder": cfg.lr, "mol_head": cfg.head_lr}
            elif s.kind == "mol":
                entry["learning_rate"] = {"encoder": cfg.lr, "mol_head": find_mol(model).learning_rate}
            if losses:
                entry["train_loss"] = _loss_summary(losses)
        if s.kind == "dense":
            encoder = ProbBiEncoder(h.encoding_model(model), batch_size=ENCODE_BATCH, verbose=False)
            index = h.dense_index(s.model_name, encoder, coll)
            with h.stage(f"retrieve_{s.model_name}", f"{s.name}: top {cfg.k} of {coll.name} for {len(topics)} queries"):
                run = TopKRetriever(index, num_results=cfg.k)(encoder.query_encoder()(topics))
        else:
            encoder = MoLEncoder(h.encoding_model(model), batch_size=ENCODE_BATCH)
            index = h.mol_index(s.model_name, encoder, coll)
            mol = find_mol(model)
            msg = f"{s.name}: brute-force top {cfg.k} of {coll.name} for {len(topics)} queries"
            with h.stage(f"retrieve_{s.model_name}", msg):
                queries = encoder.query_encoder()(topics)
                run = MoLRetriever(index, mol, method="brute_force", num_results=cfg.k)(queries)
            with h.stage(f"gate_{s.model_name}", f"{s.name}: gate statistics"):
                q_comps = np.stack(queries["query_comp"].to_list()).astype(np.float32)
                q_feats = np.stack(queries["query_feat"].to_list()) if "query_feat" in queries else None
                qpos = {q: i for i, q in enumerate(queries["qid"])}
                rel = qrels[(qrels["label"] > 0) & qrels["qid"].isin(qpos)]
                rel_ids = index.docids_of(rel["docno"].astype(str).to_numpy())
                keep = rel_ids >= 0
                mol.eval()
                gate[s.name] = {
                    f"top-{cfg.k}": gate_statistics(
                        mol,
                        q_comps,
                        index.components(),
                        run["qid"].map(qpos).to_numpy(),
                        run["docid"].to_numpy(),
                        q_feats,
                        index.features(),
                    ),
                    "relevant": gate_statistics(
                        mol,
                        q_comps,
                        index.components(),
                        rel["qid"].map(qpos).to_numpy()[keep],
                        rel_ids[keep],
                        q_feats,
                        index.features(),
                    ),
                }
        runs[s.name] = run[["qid", "docno", "score", "rank"]]
        info[s.name] = entry
        del model, encoder, index
        gc.collect()

    measures = [nDCG @ 10, R @ cfg.k]
    with h.stage("evaluate", f"pt.Experiment on {coll.name}/{data.test} ({len(topics)} queries)"):
        experiment = h.experiment(runs, topics, qrels, measures, baseline=baseline)
    experiment.insert(1, "similarity", [info[n]["similarity"] for n in experiment["name"]])
    experiment.insert(2, "fine-tuned", [("loss" in info[n]) for n in experiment["name"]])

    gate_rows = [
        {"system": name, "pairs_of": which, **{k: v for k, v in g.items() if not k.startswith("usage")}}
        for name, by in gate.items()
        for which, g in by.items()
    ]
    gate_table = pd.DataFrame(gate_rows)
    training = pd.DataFrame(
        [{"system": n, "loss": e["loss"], **e.get("train_loss", {})} for n, e in info.items() if "loss" in e]
    )
    summary = {
        "systems": names,
        "significance": (
            f"paired t-test per measure against {baseline!r} (pt.Experiment, no correction)"
            if baseline
            else "none (one system)"
        ),
        "measures": [str(m) for m in measures],
        "base_model": cfg.model or f"packaged all-MiniLM-L6-v2 ({default_model_path()})",
        "given_model_is_mol": given_is_mol,
        "retrieval": {
            "dense": "DenseIndex + TopKRetriever",
            "mol": "MoLIndex + MoLRetriever(method='brute_force')",
            "num_results": cfg.k,
        },
        "per_system": info,
        "gate": gate,
        "models": {s.name: h.path("models", s.model_name) for s in systems if s.loss is not None and data.train},
    }
    md = _markdown(experiment, gate_table, training, measures, summary)
    if data.train:
        title = "Mixture-of-Logits against the dot-product bi-encoder (same backbone and budget)"
    else:
        title = f"Mixture-of-Logits: {cfg.model or 'the base model'} without fine-tuning"
    tables = {"results": experiment, "gate": gate_table, "training": training}
    summary = h.finish(title, md, tables, summary, data)
    return {"experiment": experiment, "gate": gate_table, "training": training, "summary": summary}


def _markdown(
    experiment: pd.DataFrame,
    gate: pd.DataFrame,
    training: pd.DataFrame,
    measures: list[Any],
    summary: dict[str, Any],
) -> str:
    """The job's tables as Markdown (what goes into the README)."""
    ms = [str(m) for m in measures]
    sig = summary["significance"]
    lines = ["", f"`*`: p < 0.05, {sig}." if sig.startswith("paired") else "No significance test (one system).", ""]
    lines += ["| system | similarity | fine-tuned | " + " | ".join(ms) + " |", "|---|---|---|" + "---|" * len(ms)]
    for _, r in experiment.iterrows():
        cells = [f"{r[m]:.4f}{p_mark(r.get(f'{m} p-value', np.nan))}" for m in ms]
        tuned = "yes" if r["fine-tuned"] else "no"
        lines.append(f"| {r['name']} | {r['similarity']} | {tuned} | " + " | ".join(cells) + " |")
    if len(gate):
        lines += [
            "",
            "Gate pi(q, x) of the MoL models (nats; uniform: H(pi|q,x) = H(p) = log P, MI = 0):",
            "",
        ]
        cols = ["system", "pairs_of", "pairs", "log_P", "H_pi_given_qx", "H_p", "MI", "mean_max_pi"]
        lines.append(markdown_table(gate[cols]))
    if len(training):
        lines += ["", "Training loss:", ""]
        cols = [c for c in ("system", "loss", "first", "last", "mean_first_10", "mean_last_10") if c in training]
        lines.append(markdown_table(training[cols]))
    return "\n".join(lines) + "\n"
