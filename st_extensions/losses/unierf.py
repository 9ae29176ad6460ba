"""The UniERF loss (Jiang et al., KDD'25, ``../shared/papers/unierf.md``, Sec. 4.4, Eq. 28-32).

L = L_pos + L_trip + L_Info + L_diversity (Eq. 32), the first three per branch, the fourth across a query's branches;
:class:`FrozenDocumentTower` keeps the shared item tower (Sec. 4.2) fixed while the query tower trains
(``docs/unierf.md``, the training loss).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from sentence_transformers import SentenceTransformer
from sentence_transformers.base.losses.merged_forward import embed_columns
from torch import Tensor, nn

from st_extensions.checks import finite_float, positive_float
from st_extensions.distributed import global_batch
from st_extensions.judged import JudgedPairs
from st_extensions.losses._checks import check_not_empty
from st_extensions.unierf import find_branches, parse_unierf_columns, unierf_columns

UNIERF_CITATION = """
@inproceedings{jiang2025unierf,
    title={UniERF: A Uniform Embedding-based Retrieval Framework for E-Commerce Search},
    author={Hao Jiang and Xiaoyu He and Fanyi Qu and Congcong Liu and Xue Jiang and Changping Peng
            and Zhangang Lin and Ching Law and Jingping Shao},
    booktitle={Proceedings of the 31st ACM SIGKDD Conference on Knowledge Discovery and Data Mining V.2},
    year={2025},
    doi={10.1145/3711896.3737270},
}
"""

TERMS: tuple[str, ...] = ("positive", "triplet", "infonce", "diversity")

__all__ = ["TERMS", "FrozenDocumentTower", "UniERFLoss", "UniERFLossConfig", "diversity_loss"]


def diversity_loss(branch_embeddings: Tensor, scale: float, margin: float, threshold: float) -> Tensor:
    """L_diversity of Eq. 31 for ``(batch, n_branches, dim)`` L2-normalised embeddings, averaged over the batch.

    Per query ``log(1 + sum_{i<k} exp(tau * eta_ik * (s_ik - Delta)))``, ``eta_ik = [s_ik - alpha]_+`` detached (as in
    Circle Loss), tau = ``scale``, Delta = ``margin``, alpha = ``threshold``: zero gradient below alpha. One branch: 0.
    """
    if branch_embeddings.ndim != 3:
        raise ValueError(
            f"branch embeddings must have shape (batch, branches, dim), got {tuple(branch_embeddings.shape)}"
        )
    n = branch_embeddings.shape[1]
    if n < 2:
        return branch_embeddings.new_zeros(())
    sims = branch_embeddings @ branch_embeddings.transpose(1, 2)
    i, k = torch.triu_indices(n, n, offset=1, device=sims.device)
    s = sims[:, i, k]
    eta = (s - threshold).clamp_min(0.0).detach()
    logits = scale * eta * (s - margin)
    # log(1 + sum exp(x)) = logsumexp([0, x_1, ..., x_m])
    return torch.logsumexp(F.pad(logits, (1, 0)), dim=1).mean()


class FrozenDocumentTower:
    """UniERF's shared item tower (``E_I`` of Eq. 28-30) held fixed while the query tower trains.

    A frozen deep copy of ``model`` (eval, no gradient, not a submodule of the loss) embeds the loss's document columns;
    with ``cache`` each document's vector is kept by its token ids, and :meth:`prime` fills the cache from precomputed
    vectors (``docs/unierf.md``)."""

    def __init__(self, model: SentenceTransformer, cache: bool = True) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a SentenceTransformer, got {type(model).__name__}")
        self.encoder = copy.deepcopy(model).eval().requires_grad_(False)
        self.use_cache = bool(cache)
        self._cache: dict[bytes, Tensor] = {}
        self.hits = self.computed = self.primed = 0

    def __repr__(self) -> str:
        return f"FrozenDocumentTower(cached={len(self._cache)}, hits={self.hits}, computed={self.computed})"

    @staticmethod
    def row_keys(features: Mapping[str, Any]) -> list[bytes]:
        """The cache key of every row of a tokenised column: its token ids where the attention mask is set."""
        ids = features["input_ids"].detach().cpu().numpy().astype(np.int64, copy=False)
        mask = features.get("attention_mask")  # a whole row's ids when there is none
        if mask is None:
            return [row.tobytes() for row in ids]
        return [row[m].tobytes() for row, m in zip(ids, mask.detach().cpu().numpy().astype(bool, copy=False))]

    @torch.no_grad()
    def _forward(self, features: Mapping[str, Any]) -> Tensor:
        self.encoder.to(features["input_ids"].device).eval()
        return F.normalize(self.encoder(dict(features))["sentence_embedding"].float(), dim=-1)

    @torch.no_grad()
    def embed(self, features: Mapping[str, Any]) -> Tensor:
        """``(batch, dim)`` L2-normalised document embeddings of one tokenised column, without gradient."""
        if not self.use_cache:
            self.computed += int(features["input_ids"].shape[0])
            return self._forward(features)
        keys = self.row_keys(features)
        missing = [i for i, k in enumerate(keys) if k not in self._cache]
        if missing:  # the sub-batch of the missing rows: tensors whose first axis is the batch are indexed
            index = torch.as_tensor(missing)
            batch = {
                k: v[index.to(v.device)] if isinstance(v, Tensor) and v.ndim and len(v) == len(keys) else v
                for k, v in features.items()
            }
            self._cache.update(zip([keys[i] for i in missing], self._forward(batch).cpu()))
            self.computed += len(missing)
        self.hits += len(keys) - len(missing)
        return torch.stack([self._cache[k] for k in keys]).to(features["input_ids"].device)

    def embed_columns(self, features_list: Iterable[Mapping[str, Any]]) -> list[Tensor]:
        """:meth:`embed` of every column."""
        return [self.embed(f) for f in features_list]

    @torch.no_grad()
    def prime(self, texts: Sequence[str], vectors: Any, check: int = 4, atol: float = 1e-3, chunk: int = 256) -> int:
        """Cache precomputed embeddings of ``texts``, tokenised as the trainer's collator does; returns how many.

        The first ``check`` texts are re-embedded and must agree within ``atol`` (else ``ValueError``: another model or
        ``max_seq_length``)."""
        texts = [str(t) for t in texts]
        vecs = torch.as_tensor(np.asarray(vectors, dtype=np.float32))
        if vecs.ndim != 2 or vecs.shape[0] != len(texts):
            raise ValueError(f"need one vector per text ({len(texts)}), got an array of shape {tuple(vecs.shape)}")
        vecs = F.normalize(vecs, dim=-1)
        if check and texts:
            n = min(check, len(texts))
            mine = self._forward(self.encoder.preprocess(texts[:n])).cpu()
            err = float((mine - vecs[:n]).abs().max())
            if err > atol:
                raise ValueError(
                    f"the given vectors differ from the frozen encoder's embeddings of the same texts by up to "
                    f"{err:.3g} (> atol {atol:g}): they come from another model or another max_seq_length"
                )
        for start in range(0, len(texts), chunk):
            features = self.encoder.preprocess(texts[start : start + chunk])
            self._cache.update(zip(self.row_keys(features), vecs[start : start + chunk].clone()))
        self.primed += len(texts)
        return len(texts)

    @property
    def stats(self) -> dict[str, int]:
        """``cached`` embeddings, ``primed`` texts, cache ``hits`` and documents ``computed`` by the encoder."""
        return {"cached": len(self._cache), "primed": self.primed, "hits": self.hits, "computed": self.computed}


@dataclass
class UniERFLossConfig:
    """The hyperparameters of Eq. 28-31: beta (``positive_threshold``), gamma (``triplet_margin``), tau
    (``temperature``), the diversity term's tau, Delta, alpha (``diversity_scale``, ``_margin``, ``_threshold``;
    Sec. 5.3.2's 32, 0.8, 0.6), and which terms of Eq. 32 are on (``use_*``). :class:`UniERFLoss` takes them as
    keywords too."""

    positive_threshold: float = 0.5
    triplet_margin: float = 0.1
    temperature: float = 0.05
    diversity_scale: float = 32.0
    diversity_margin: float = 0.8
    diversity_threshold: float = 0.6
    use_positive: bool = True
    use_triplet: bool = True
    use_infonce: bool = True
    use_diversity: bool = True

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name.startswith("use_"):
                setattr(self, f.name, bool(value))
            else:
                check = positive_float if f.name in ("temperature", "diversity_scale") else finite_float
                setattr(self, f.name, check(f.name, value))
        if not any(self.use.values()):
            raise ValueError("every term of the UniERF loss is switched off")

    @property
    def use(self) -> dict[str, bool]:
        """term -> switched on (the keys of :data:`TERMS`)."""
        return {term: getattr(self, f"use_{term}") for term in TERMS}


class UniERFLoss(nn.Module):
    """UniERF's training objective, the sum of Eq. 28-32, for a model with a MultiBranchQueryEncoder.

    Positive (Eq. 28), triplet (Eq. 29) and InfoNCE (Eq. 30, positive included) per branch over its candidates
    (positives, shared and branch-b negatives), plus :func:`diversity_loss` (Eq. 31); their hyperparameters and
    switches: a :class:`UniERFLossConfig` or its fields as keywords. ``columns``: the dataset's column names
    (:func:`st_extensions.unierf_columns` layout; inferred for B + 1, 2B + 1, 2B + 2 columns); ``ignore_columns`` are
    dropped before embedding; ``document_tower``: a :class:`FrozenDocumentTower` (else ``model`` embeds the documents);
    ``judged`` removes judged-relevant in-batch negatives; ``gather_across_devices``: DDP global batch. Terms, defaults
    and an example: ``docs/unierf.md``."""

    citation = UNIERF_CITATION

    def __init__(
        self,
        model: SentenceTransformer,
        columns: Sequence[str] | None = None,
        config: UniERFLossConfig | None = None,
        ignore_columns: Sequence[str] = (),
        document_tower: FrozenDocumentTower | None = None,
        judged: JudgedPairs | None = None,
        gather_across_devices: bool = False,
        **options: Any,
    ) -> None:
        super().__init__()
        if config is not None and options:
            raise TypeError(f"pass either config or keyword options, not both (got {sorted(options)})")
        self.config = config if config is not None else UniERFLossConfig(**options)
        self.model, self.judged, self.gather_across_devices = model, judged, bool(gather_across_devices)
        self.head = find_branches(model)
        if document_tower is not None and not isinstance(document_tower, FrozenDocumentTower):
            raise TypeError(f"document_tower must be a FrozenDocumentTower, got {type(document_tower).__name__}")
        self.document_tower = document_tower
        self.columns = None if columns is None else list(columns)
        self.ignore_columns = [str(c) for c in ignore_columns]
        if self.ignore_columns and self.columns is None:
            raise ValueError("ignore_columns needs columns= (the training dataset's column names)")
        unknown = [c for c in self.ignore_columns if c not in self.columns]
        if unknown:
            raise ValueError(f"ignore_columns {unknown} are not among the columns {self.columns}")
        kept = None if self.columns is None else [c for c in self.columns if c not in self.ignore_columns]
        self.layout = None if kept is None else parse_unierf_columns(kept, self.head.branches)

    def _layout(self, n_columns: int) -> tuple[list[str], list[str | None]]:
        """(anchor branches, negative tags) for a batch of ``n_columns`` columns."""
        if self.layout is not None:
            anchors, negatives = self.layout
            if n_columns != len(anchors) + 1 + len(negatives) + len(self.ignore_columns):
                raise ValueError(
                    f"UniERFLoss was given columns {self.columns} ({len(self.columns)}) but the batch has "
                    f"{n_columns} input columns: pass the training dataset's column names, without id/label columns"
                )
            return self.layout
        branches = self.head.branches
        b = len(branches)
        for random_negative, hard_negatives in ((False, False), (False, True), (True, True)):  # b+1, 2b+1, 2b+2
            names = unierf_columns(branches, random_negative, hard_negatives)
            if len(names) == n_columns:
                return parse_unierf_columns(names, branches)
        raise ValueError(
            f"UniERFLoss cannot read a batch of {n_columns} columns for the branches {branches}: expected "
            f"{b + 1}, {2 * b + 1} or {2 * b + 2} (see st_extensions.unierf_columns), or pass "
            "columns=train.column_names"
        )

    def embed(
        self, sentence_features: Iterable[dict[str, Tensor]]
    ) -> tuple[dict[str, Tensor], Tensor, list[Tensor], list[str | None]]:
        """``(H per anchor branch (B, dim), positives (B, dim), negatives [(B, dim)], negative tags)``, normalised."""
        features = list(sentence_features)
        anchors, tags = self._layout(len(features))
        if self.ignore_columns:
            features = [f for f, c in zip(features, self.columns) if c not in self.ignore_columns]
        features = check_not_empty("UniERFLoss", features)
        k = len(anchors)
        branch_emb = {
            branch: self.head.embed(self.model(f)["sentence_embedding"], branch)
            for branch, f in zip(anchors, features[:k])
        }
        if self.document_tower is not None:
            docs = self.document_tower.embed_columns(features[k:])
        else:
            docs = [F.normalize(e, dim=-1) for e in embed_columns(self.model, features[k:], separate_first=False)]
        return branch_emb, docs[0], docs[1:], tags

    def terms_from_embeddings(
        self,
        branch_emb: dict[str, Tensor],
        positives: Tensor,
        negatives: Sequence[Tensor],
        tags: Sequence[str | None],
        labels: Tensor | None = None,
    ) -> dict[str, Tensor]:
        """The four terms of Eq. 32 from normalised embeddings (documents gathered over DDP ranks first)."""
        cfg, batch = self.config, global_batch(positives.shape[0], self.gather_across_devices)
        rows = torch.arange(batch.size, device=positives.device)
        target = batch.targets(positives.device)
        positives = batch.candidates(positives)
        negatives = [batch.candidates(n) for n in negatives]
        labels = batch.labels(labels) if self.judged is not None else labels
        out = dict.fromkeys(("positive", "triplet", "infonce"), positives.new_zeros(()))
        for branch, h in branch_emb.items():
            cands = torch.cat([positives, *(n for n, t in zip(negatives, tags) if t is None or t == branch)], dim=0)
            scores = h @ cands.T  # (B, W * B * (1 + m_b)); column offset + i is row i's positive
            pos = scores[rows, target]
            out["positive"] = out["positive"] + (cfg.positive_threshold - pos).clamp_min(0.0).mean()
            judged = self.judged.mask(labels, scores.shape[1], batch.offset, batch.size) if self.judged else None
            judged = torch.zeros_like(scores, dtype=torch.bool) if judged is None else judged.to(scores.device)
            if scores.shape[1] > 1:
                is_neg = ~judged
                is_neg[rows, target] = False
                hinge = (scores - pos[:, None] + cfg.triplet_margin).clamp_min(0.0)
                # each device keeps a different number of negative pairs: the mean is over the global count
                out["triplet"] = out["triplet"] + batch.mean(hinge[is_neg])
            logits = (scores / cfg.temperature).masked_fill(judged, float("-inf"))
            out["infonce"] = out["infonce"] + F.cross_entropy(logits, target)
        # the diversity term is per query (its branches only): the local mean is this device's share
        stacked = torch.stack([branch_emb[b] for b in self.head.branches if b in branch_emb], dim=1)
        out["diversity"] = diversity_loss(stacked, cfg.diversity_scale, cfg.diversity_margin, cfg.diversity_threshold)
        return out

    def loss_terms(
        self, sentence_features: Iterable[dict[str, Tensor]], labels: Tensor | None = None
    ) -> dict[str, Tensor]:
        """Every term of Eq. 32 (``positive``, ``triplet``, ``infonce``, ``diversity``), switched on or not."""
        return self.terms_from_embeddings(*self.embed(sentence_features), labels=labels)

    def forward(self, sentence_features: Iterable[dict[str, Tensor]], labels: Tensor | None = None) -> Tensor:
        terms = self.loss_terms(sentence_features, labels)
        return torch.stack([terms[name] for name in TERMS if self.config.use[name]]).sum()

    def get_config_dict(self) -> dict[str, Any]:
        return {
            "columns": self.columns,
            **asdict(self.config),
            "ignore_columns": list(self.ignore_columns),
            "document_tower": "frozen" if self.document_tower is not None else "shared (trained)",
            "gather_across_devices": self.gather_across_devices,
        }
