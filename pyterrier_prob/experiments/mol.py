"""The Mixture-of-Logits experiment (``pyterrier-prob mol``; Ding & Zhai, WWW'25,
``shared/papers/mixture-of-logits.txt``): MoL's learned similarity (Eqs. 1-2) trained with the sampled softmax plus
alpha * L_MI (Eqs. 3-4) against the dot-product bi-encoder, same backbone, pairs and budget. The stages can be called
one by one; the protocol: ``docs/mol.md``."""

from __future__ import annotations

import gc
import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import pandas as pd

from pyterrier_prob.experiments.claims import perquery_claims, record_claims
from pyterrier_prob.experiments.harness import (
    CommonConfig,
    Data,
    Harness,
    TrainingPairs,
    base_model,
    loss_ends,
    markdown_table,
    measure_cell,
    option,
    subcommand,
)
from pyterrier_prob.mol import MoLEncoder, MoLRetriever
from pyterrier_prob.mol.gate import gate_statistics
from pyterrier_prob.pebr import ProbBiEncoder, TopKRetriever
from st_extensions import MixtureOfLogits, build_mol_model, default_model_path, encode_components, find_mol, load_model
from st_extensions.losses import MaskedMultipleNegativesRankingLoss, MoLLoss

__all__ = [
    "DESCRIPTION",
    "HEAD_PARAMS",
    "MolJobConfig",
    "add_arguments",
    "config_from_args",
    "evaluate",
    "gate_statistics",
    "report",
    "retrieve_dense",
    "retrieve_mol",
    "run",
    "run_mol_job",
    "systems",
    "train_system",
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
MOL_UNTRAINED = "MoL (no fine-tuning)"  #: system names; significance against BASELINE (REFERENCE: nothing trains)

#: Parameters of the MixtureOfLogits module (pooling, projections or heads, gate): the ones ``--head-lr`` sets.
HEAD_PARAMS = r"(^|\.)(query_pool|doc_pool|query_proj|doc_proj|query_heads|doc_heads|gate_net)\."

ENCODE_BATCH = 64
RETRIEVAL = {"dense": "DenseIndex + TopKRetriever", "mol": "MoLIndex + MoLRetriever(method='brute_force')"}


@dataclass
class MolJobConfig(CommonConfig):
    """The ``pyterrier-prob mol`` options beyond :class:`CommonConfig`'s, each field's help its documentation."""

    output: str = "outputs/mol"
    alpha: float = option(0.001, "weight of L_MI (Eq. 3) in MoLLoss (Eq. 4) for the MoL row")
    scale: float = option(20.0, "softmax scale (1/temperature) of both losses")
    head_lr: float | None = option(
        None,
        "learning rate of the new MoL parameters (HEAD_PARAMS; default: the rate MixtureOfLogits declares, chosen "
        "on nfcorpus dev by benchmarks/recipe_search.py)",
    )
    pq: int = option(4, "P_q, query component embeddings")
    px: int = option(4, "P_x, document component embeddings")
    component_dim: int | None = option(
        None, "d_P (default: the encoder's hidden size for tokens, its embedding size for heads)"
    )
    component_source: str = option(
        "heads",
        "heads: linear heads on the pooled embedding (what the frozen recipe trains); tokens: aggregation tokens "
        "read by parameterised pooling (App. A.2; needs a recipe that trains the encoder)",
        choices=("tokens", "heads"),
    )
    head_init: str = option(
        "identity",
        "heads: start every component at the pooled embedding (identity + noise, needs the default d_P: the untrained "
        "MoL scores as the base model) or at independent orthogonal maps",
        choices=("identity", "orthogonal"),
    )
    k: int = option(100, "documents retrieved per query (R@k is measured at this depth)")
    mi_ablation: bool = option(False, "also train MoL with alpha = 0 (the paper's 'abl. L_MI' row)")

    def check(self) -> None:
        """Raise ``ValueError`` naming the first setting out of range."""
        super().check()
        if not (math.isfinite(self.alpha) and self.alpha >= 0):
            raise ValueError(f"--alpha must be finite and >= 0, got {self.alpha}")
        if not (math.isfinite(self.scale) and self.scale > 0):
            raise ValueError(f"--scale must be > 0, got {self.scale}")
        if self.head_lr is not None and not (math.isfinite(self.head_lr) and self.head_lr > 0):
            raise ValueError(f"--head-lr must be finite and > 0, got {self.head_lr}")
        if self.pq < 1 or self.px < 1:
            raise ValueError(f"--pq and --px must be >= 1, got {self.pq} and {self.px}")
        if self.component_dim is not None and self.component_dim < 1:
            raise ValueError(f"--component-dim must be >= 1, got {self.component_dim}")
        if self.component_source == "tokens" and self.steps and self.training_recipe(1).caches_features:
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


add_arguments, config_from_args = subcommand(MolJobConfig, "Mixture-of-Logits")  # what ``pyterrier-prob`` calls


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


def _mol_model(cfg: MolJobConfig, given_is_mol: bool) -> Any:
    """The MoL model: a saved MoL ``--model`` as it is (training continues), else MoL modules on the base model."""
    model = base_model(cfg)
    if given_is_mol:
        return model
    model.max_seq_length = cfg.max_seq_length  # the position pooling covers the inputs the model will see
    tokens_train = cfg.component_source == "tokens" and cfg.training_recipe().caches_states  # inputs of the top layers
    token_layer = model[0].auto_model.config.num_hidden_layers - cfg.train_layers if tokens_train else None
    components = {"num_query_components": cfg.pq, "num_doc_components": cfg.px, "component_dim": cfg.component_dim}
    components |= {"component_source": cfg.component_source, "head_init": cfg.head_init}
    return build_mol_model(model, **components, token_layer=token_layer, seed=cfg.seed, device="cpu")


def systems(cfg: MolJobConfig, h: Harness, data: Data, pairs: TrainingPairs, given_is_mol: bool) -> list[_System]:
    """The systems of this run, in table order (``docs/mol.md``, The protocol)."""
    ref = "untrained"  # the harness reuses its index only for the same --model and --max-seq-length
    out = [_System(REFERENCE, ref, "dense", partial(base_model, cfg), None)]
    if data.train is None:
        if given_is_mol:
            out.append(_System(MOL_UNTRAINED, ref + "-mol", "mol", partial(base_model, cfg), None))
        return out
    mapping = {HEAD_PARAMS: cfg.head_lr} if cfg.head_lr is not None else None
    dense_loss = partial(pairs.loss, cls=MaskedMultipleNegativesRankingLoss, scale=cfg.scale)
    out.append(_System(BASELINE, "bi-encoder", "dense", partial(base_model, cfg, h.recipe.caches_features), dense_loss))
    alphas = [(MOL, "mol", cfg.alpha)] + ([(MOL_NO_MI, "mol-no-lmi", 0.0)] if cfg.mi_ablation else [])
    for name, model_name, alpha in alphas:
        loss = partial(pairs.loss, cls=MoLLoss, alpha=alpha, scale=cfg.scale)
        build = partial(_mol_model, cfg, given_is_mol)
        out.append(_System(name, model_name, "mol", build, loss, alpha=alpha, mapping=mapping))
    return out


def run_mol_job(cfg: MolJobConfig) -> dict[str, Any]:
    """Run the MoL experiment (``docs/mol.md``) into ``cfg.output``; returns its tables and ``"summary"``."""
    h = Harness("mol", cfg)
    given = load_model(cfg.model, device="cpu") if cfg.model else None
    given_is_mol = given is not None and any(isinstance(m, MixtureOfLogits) for m in given.modules())
    if not given_is_mol:  # the MoL heads are built on it: a bad --component-dim fails now, not after the bi-encoder
        _check_component_dim(cfg, given)
    del given
    data = h.load_data(calibrate=bool(cfg.dev_every) or h.recipe.trains_encoder, for_training=True)  # for the curves
    if given_is_mol:
        data.notes.append(f"--model {cfg.model} is a MoL model: the dense rows read its pooled embedding")
    pairs = TrainingPairs(data, cfg.seed)  # the same rows (and, through the seed, batches) for every system
    rows = systems(cfg, h, data, pairs, given_is_mol)
    if len(rows) == 1:
        data.notes.append(
            f"nothing to fine-tune and {cfg.model or 'the base model'} has no MoL head: only its dense row "
            "(pass a saved MoL model as --model to evaluate its MoL similarity too)"
        )
    runs, info, gate = {}, {}, {}  # system -> its run, its summary entry, its gate statistics
    for s in rows:
        model, info[s.name] = train_system(cfg, h, data, s, pairs)
        if s.kind == "dense":
            runs[s.name] = retrieve_dense(cfg, h, data, s, model)
        else:
            runs[s.name], gate[s.name] = retrieve_mol(cfg, h, data, s, model)
        del model
        gc.collect()
    names = [s.name for s in rows]
    baseline = BASELINE if BASELINE in names else (REFERENCE if len(names) > 1 else None)
    experiment = evaluate(cfg, h, data, runs, info, baseline)
    if baseline == BASELINE:  # claim mol_vs_dot: each trained MoL system against the dot-product model
        trained = [s.name for s in rows if s.kind == "mol" and s.loss is not None]
        claims = [perquery_claims(h, runs, data, "mol", "mol_vs_dot", n, BASELINE, _measures(cfg)) for n in trained]
        # the construction is part of the system's name, so that the heads and tokens rows do not replace each other
        src = cfg.component_source
        claim_rows = [{**r, "system": f"{r['system']} ({src})", "construction": src} for rs in claims for r in rs]
        record_claims(cfg, claim_rows)
    return report(cfg, h, data, rows, experiment, info, gate, given_is_mol, baseline)


def _check_component_dim(cfg: MolJobConfig, given: Any) -> None:
    """``--head-init identity`` (heads) starts every component at the pooled embedding: ``--component-dim`` must be
    the base model's embedding dimension (known only once it is loaded)."""
    if cfg.component_source != "heads" or cfg.head_init != "identity" or cfg.component_dim is None:
        return
    dim = (given if given is not None else base_model(cfg)).get_embedding_dimension()
    if dim is not None and cfg.component_dim != dim:
        raise ValueError(
            f"--head-init identity starts every component at the pooled embedding, so it needs --component-dim equal "
            f"to the embedding dimension of {cfg.model or 'the base model'} ({dim}), got --component-dim "
            f"{cfg.component_dim}: use --head-init orthogonal (or leave --component-dim out)"
        )


def train_system(
    cfg: MolJobConfig, h: Harness, data: Data, s: _System, pairs: TrainingPairs
) -> tuple[Any, dict[str, Any]]:
    """Fine-tune (or build) one system's model; returns it and its summary entry (loss, rates, training loss)."""
    entry: dict[str, Any] = {"similarity": "MoL (Eq. 1-2)" if s.kind == "mol" else "cosine"}
    mol_settings = {"pq": cfg.pq, "px": cfg.px, "component_dim": cfg.component_dim, "source": cfg.component_source}
    mol_settings |= {"head_init": cfg.head_init} if cfg.component_source == "heads" else {}  # --reuse: another init
    settings = {"system": s.name, "train": f"{data.train_collection.name}/{data.train}", "scale": cfg.scale}
    settings |= {"alpha": s.alpha, "mol": None if s.kind == "dense" else mol_settings}
    train = pairs if s.loss is not None and data.train else None
    dev = h.dev_evaluator(data, "nDCG@10", _mol_dev_scores if s.kind == "mol" else None) if train else None
    model, losses = h.train(
        s.model_name, s.build, s.loss, train, learning_rate_mapping=s.mapping, settings=settings, dev=dev
    )
    if s.loss is not None:
        entry["loss"] = "MoLLoss" if s.kind == "mol" else "MaskedMultipleNegativesRankingLoss"
        entry.update(recipe=h.recipe.mode, scale=cfg.scale, **({"alpha": s.alpha} if s.alpha is not None else {}))
        if s.kind == "mol":  # --head-lr (s.mapping), else the rate MixtureOfLogits declares
            head = cfg.head_lr if s.mapping else find_mol(model).learning_rate
            encoder = {"encoder": cfg.lr} if h.recipe.trains_encoder else {}  # frozen: only the MoL modules train
            entry["learning_rate"] = {**encoder, "mol_head": head}
        if losses:
            entry["train_loss"] = _loss_summary(losses)
    return model, entry


def _mol_dev_scores(model: Any, topics: pd.DataFrame, texts: list[str]) -> np.ndarray:
    """phi(q, x) (Eq. 1) of the dev queries against the dev pool (the MoL systems' dev measure)."""
    q, qf = encode_components(model, topics["query"].tolist(), "query", return_features=True)
    x, xf = encode_components(model, texts, "document", return_features=True)
    return find_mol(model).score_all(q, x, qf, xf).float().cpu().numpy()


def _measures(cfg: MolJobConfig) -> list[str]:
    return ["nDCG@10", f"R@{cfg.k}"]


def _loss_summary(losses: list[float]) -> dict[str, Any]:
    first10, last10 = loss_ends(losses)
    ends = {"first": losses[0], "last": losses[-1], "mean_first_10": first10, "mean_last_10": last10}
    return {**{k: round(v, 4) for k, v in ends.items()}, "steps_logged": len(losses)}


def retrieve_dense(cfg: MolJobConfig, h: Harness, data: Data, s: _System, model: Any) -> pd.DataFrame:
    """Index the test collection with a dense system and retrieve the top ``k`` (cosine) for every test query."""
    topics, coll = data.test_topics, data.test_collection
    encoder = ProbBiEncoder(h.encoding_model(model), batch_size=ENCODE_BATCH, verbose=False)
    index = h.dense_index(s.model_name, encoder, coll)
    with h.stage(f"retrieve_{s.model_name}", f"{s.name}: top {cfg.k} of {coll.name} for {len(topics)} queries"):
        run = TopKRetriever(index, num_results=cfg.k)(encoder.query_encoder()(topics))
    return run[["qid", "docno", "score", "rank"]]


def retrieve_mol(
    cfg: MolJobConfig, h: Harness, data: Data, s: _System, model: Any
) -> tuple[pd.DataFrame, dict[str, Any]]:
    """Index with a MoL system, retrieve the top ``k`` by brute force (Sec. 3.1) and summarise its gate."""
    topics, qrels, coll = data.test_topics, data.test_qrels, data.test_collection
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
        pairs = {
            f"top-{cfg.k}": (run["qid"].map(qpos).to_numpy(), run["docid"].to_numpy()),
            "relevant": (rel["qid"].map(qpos).to_numpy()[keep], rel_ids[keep]),
        }
        gate = {
            which: gate_statistics(mol, q_comps, index.components(), qi, ids, q_feats, index.features())
            for which, (qi, ids) in pairs.items()
        }
    return run[["qid", "docno", "score", "rank"]], gate


def evaluate(
    cfg: MolJobConfig, h: Harness, data: Data, runs: dict[str, pd.DataFrame], info: dict, baseline: str | None
) -> pd.DataFrame:
    """``pt.Experiment`` of every system's run: nDCG@10 and R@k, paired t-tests against ``baseline``."""
    coll, topics = data.test_collection, data.test_topics
    with h.stage("evaluate", f"pt.Experiment on {coll.name}/{data.test} ({len(topics)} queries)"):
        experiment = h.experiment(runs, topics, data.test_qrels, _measures(cfg), baseline=baseline)
    experiment.insert(1, "similarity", [info[n]["similarity"] for n in experiment["name"]])
    experiment.insert(2, "fine-tuned", [("loss" in info[n]) for n in experiment["name"]])
    return experiment


def report(
    cfg: MolJobConfig,
    h: Harness,
    data: Data,
    rows: list[_System],
    experiment: pd.DataFrame,
    info: dict[str, dict[str, Any]],
    gate: dict[str, dict[str, Any]],
    given_is_mol: bool,
    baseline: str | None,
) -> dict[str, Any]:
    """The gate and training tables, ``summary.json`` and ``results.md`` (:meth:`Harness.finish`)."""
    gate_table = pd.DataFrame(
        {"system": name, "pairs_of": which, **{k: v for k, v in g.items() if not k.startswith("usage")}}
        for name, by in gate.items()
        for which, g in by.items()
    )
    training = pd.DataFrame(
        [{"system": n, "loss": e["loss"], **e.get("train_loss", {})} for n, e in info.items() if "loss" in e]
    )
    measures = _measures(cfg)
    significance = f"paired t-test per measure against {baseline!r} (pt.Experiment, no correction)"
    summary = {
        "systems": [s.name for s in rows],
        "significance": significance if baseline else "none (one system)",
        "measures": measures,
        "base_model": cfg.model or f"packaged all-MiniLM-L6-v2 ({default_model_path()})",
        "given_model_is_mol": given_is_mol,
        "retrieval": {**RETRIEVAL, "num_results": cfg.k},
        "per_system": info,
        "gate": gate,
        "models": {s.name: h.path("models", s.model_name) for s in rows if s.loss is not None and data.train},
    }
    md = _markdown(experiment, gate_table, training, measures, summary["significance"])
    if data.train:
        title = "Mixture-of-Logits against the dot-product bi-encoder (same backbone and budget)"
    else:
        title = f"Mixture-of-Logits: {cfg.model or 'the base model'} without fine-tuning"
    summary = h.finish(title, md, {"results": experiment, "gate": gate_table, "training": training}, summary, data)
    return {"experiment": experiment, "gate": gate_table, "training": training, "summary": summary}


def _markdown(
    experiment: pd.DataFrame, gate: pd.DataFrame, training: pd.DataFrame, measures: list[str], significance: str
) -> str:
    """The job's tables as Markdown (what goes into the README)."""
    paired = significance.startswith("paired")
    table = pd.DataFrame({"system": experiment["name"], "similarity": experiment["similarity"]})
    table["fine-tuned"] = ["yes" if t else "no" for t in experiment["fine-tuned"]]
    for m in measures:
        table[m] = [measure_cell(r, m) for _, r in experiment.iterrows()]
    parts = [
        f"`*`: p < 0.05, {significance}." if paired else "No significance test (one system).",
        markdown_table(table),
    ]
    if len(gate):
        cols = ["system", "pairs_of", "pairs", "log_P", "H_pi_given_qx", "H_p", "MI", "mean_max_pi"]
        parts += [
            "Gate pi(q, x) of the MoL models (nats; uniform: H(pi|q,x) = H(p) = log P, MI = 0):",
            markdown_table(gate[cols]),
        ]
    if len(training):
        cols = [c for c in ("system", "loss", "first", "last", "mean_first_10", "mean_last_10") if c in training]
        parts += ["Training loss:", markdown_table(training[cols])]
    return "\n" + "\n\n".join(parts) + "\n"


run = run_mol_job  # what ``pyterrier-prob mol`` runs
