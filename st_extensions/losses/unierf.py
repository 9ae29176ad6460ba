"""The UniERF loss (Jiang et al., KDD'25, ``../shared/papers/unierf.md``, Sec. 4.4, Eq. 28-32).

L = L_pos + L_trip + L_Info + L_diversity (Eq. 32), the first three per branch (each branch is a retrieval
objective of its own, with its own hard negatives, Sec. 4.3) and the fourth across the branches of a query.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from sentence_transformers import SentenceTransformer
from sentence_transformers.base.losses.merged_forward import embed_columns
from torch import Tensor, nn

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


def diversity_loss(branch_embeddings: Tensor, scale: float, margin: float, threshold: float) -> Tensor:
    """L_diversity of Eq. 31 for ``(batch, n_branches, dim)`` L2-normalised embeddings, averaged over the batch.

    Per query, over the unordered pairs i < k of its branches, with s_ik the cosine of H^i and H^k::

        L = log(1 + sum_{i<k} exp(tau * eta_ik * (s_ik - Delta))),   eta_ik = [s_ik - alpha]_+

    (tau = ``scale``, Delta = ``margin``, alpha = ``threshold``). As in Circle Loss, whose negative term this
    is, the weight eta is a constant of the backward pass (detached), so each pair's gradient is
    ``tau * eta_ik * softmax`` >= 0: similarities above alpha are pushed down, with a pull that fades as they
    approach alpha, and below alpha (eta = 0) the gradient is exactly zero -- the truncation that keeps the
    branches from drifting apart altogether (Sec. 4.4). With one branch there is no pair and the loss is 0.
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


class UniERFLoss(nn.Module):
    """UniERF's training objective, the sum of Eq. 28-32, for a model with a MultiBranchQueryEncoder.

    For branch b with embeddings H^b_i = l2_norm(W_b e(anchor_b,i)) of its anchor texts (Eq. 5), documents
    embedded by the shared document tower and normalised, ``T`` the cosine, d_i+ row i's positive and N_i^b
    row i's negatives for branch b -- the other rows' positives (batch negatives, Eq. 21), every row's shared
    negatives (e.g. random, Eq. 22) and every row's hard negatives of branch b (Sec. 4.3.3) -- the terms are

    * Eq. 28, positive loss: ``mean_i max(beta - T(H^b_i, d_i+), 0)``;
    * Eq. 29, triplet loss: ``mean_{i, n in N_i^b} max(T(H^b_i, n) - T(H^b_i, d_i+) + gamma, 0)``;
    * Eq. 30, InfoNCE: ``-mean_i log softmax_j(T(H^b_i, c_j) / tau)[d_i+]`` over the candidates
      ``c = {d_i+} u N_i^b``. (As printed, Eq. 30's denominator holds the negatives only, which has no lower
      bound; this is the InfoNCE of the cited van den Oord et al., positive included, as in
      ``MultipleNegativesRankingLoss(scale=1 / tau)``.)

    each summed over the branches, plus Eq. 31's diversity loss between the branches of each query
    (:func:`diversity_loss`, with scale ``tau_div``, margin Delta and truncation alpha; defaults alpha = 0.6,
    Delta = 0.8 from Sec. 5.3.2). Each term is switched on or off by its ``use_*`` flag (for ablations such as
    Table 2's "w.o. L_DIV"); :meth:`loss_terms` returns them one by one. The paper gives no values for beta,
    gamma, the InfoNCE temperature or the diversity scale: the defaults here are choices.

    Args:
        model: a SentenceTransformer built with :func:`st_extensions.build_unierf_model`.
        columns: the training dataset's column names (``train.column_names``) -- the layout of
            :func:`st_extensions.unierf_columns`: ``anchor_<b>`` per branch, ``positive_doc``, then ``negative*``
            columns (``negative_<b>``: branch b's hard negative; any other, e.g. ``negative_random``: shared).
            ``None``: inferred from the number of columns n with B branches -- B + 1: no explicit negatives;
            2B + 1: one hard negative per branch; 2B + 2: ``negative_random`` then one per branch.
        positive_threshold: beta of Eq. 28.
        triplet_margin: gamma of Eq. 29.
        temperature: tau of Eq. 30.
        diversity_scale: tau of Eq. 31 (a multiplier).
        diversity_margin: Delta of Eq. 31.
        diversity_threshold: alpha of Eq. 31.
        use_positive, use_triplet, use_infonce, use_diversity: switch the terms of Eq. 32.

    Requirements:
        1. The model has a :class:`~st_extensions.modules.MultiBranchQueryEncoder`.
        2. Every row carries each branch's input text of one query, its positive document and optional negatives
           (:func:`st_extensions.build_unierf_dataset`). No labels.

    Inputs:
        +----------------------------------------------------------------------------+--------+
        | Inputs                                                                     | Labels |
        +============================================================================+========+
        | (anchor_<b1>, ..., anchor_<bB>, positive_doc)                              | none   |
        +----------------------------------------------------------------------------+--------+
        | (anchor_<b1>, ..., anchor_<bB>, positive_doc, negative_random,             | none   |
        | negative_<b1>, ..., negative_<bB>)                                         |        |
        +----------------------------------------------------------------------------+--------+

    Example:
        ::

            from sentence_transformers import SentenceTransformerTrainer
            from st_extensions import build_unierf_dataset, build_unierf_model
            from st_extensions.losses import UniERFLoss

            model = build_unierf_model(branches=("semantic", "trigger"))
            train = build_unierf_dataset(anchors, positives, doc_texts, hard_negatives=hard)
            loss = UniERFLoss(model, columns=train.column_names)
            SentenceTransformerTrainer(model=model, train_dataset=train, loss=loss).train()
    """

    def __init__(
        self,
        model: SentenceTransformer,
        columns: Sequence[str] | None = None,
        positive_threshold: float = 0.5,
        triplet_margin: float = 0.1,
        temperature: float = 0.05,
        diversity_scale: float = 32.0,
        diversity_margin: float = 0.8,
        diversity_threshold: float = 0.6,
        use_positive: bool = True,
        use_triplet: bool = True,
        use_infonce: bool = True,
        use_diversity: bool = True,
    ) -> None:
        super().__init__()
        self.model = model
        self.head = find_branches(model)
        for name, value in (
            ("positive_threshold", positive_threshold),
            ("triplet_margin", triplet_margin),
            ("diversity_margin", diversity_margin),
            ("diversity_threshold", diversity_threshold),
        ):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
        for name, value in (("temperature", temperature), ("diversity_scale", diversity_scale)):
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not (math.isfinite(value) and value > 0)
            ):
                raise ValueError(f"{name} must be finite and > 0, got {value!r}")
        self.positive_threshold = float(positive_threshold)
        self.triplet_margin = float(triplet_margin)
        self.temperature = float(temperature)
        self.diversity_scale = float(diversity_scale)
        self.diversity_margin = float(diversity_margin)
        self.diversity_threshold = float(diversity_threshold)
        self.use = {
            "positive": bool(use_positive),
            "triplet": bool(use_triplet),
            "infonce": bool(use_infonce),
            "diversity": bool(use_diversity),
        }
        if not any(self.use.values()):
            raise ValueError("every term of the UniERF loss is switched off")
        self.columns = None if columns is None else list(columns)
        self.layout: tuple[list[str], list[str | None]] | None = None
        if self.columns is not None:
            self.layout = parse_unierf_columns(self.columns, self.head.branches)

    # ---------------------------------------------------------------- layout

    def _layout(self, n_columns: int) -> tuple[list[str], list[str | None]]:
        """(anchor branches, negative tags) for a batch of ``n_columns`` columns."""
        if self.layout is not None:
            anchors, negatives = self.layout
            if n_columns != len(anchors) + 1 + len(negatives):
                raise ValueError(
                    f"UniERFLoss was given columns {self.columns} ({len(self.columns)}) but the batch has "
                    f"{n_columns} input columns: pass the training dataset's column names, without id/label columns"
                )
            return self.layout
        branches = self.head.branches
        b = len(branches)
        if n_columns == b + 1:
            return parse_unierf_columns(unierf_columns(branches, False, False), branches)
        if n_columns == 2 * b + 1:
            return parse_unierf_columns(unierf_columns(branches, False, True), branches)
        if n_columns == 2 * b + 2:
            return parse_unierf_columns(unierf_columns(branches, True, True), branches)
        raise ValueError(
            f"UniERFLoss cannot read a batch of {n_columns} columns for the branches {branches}: expected "
            f"{b + 1}, {2 * b + 1} or {2 * b + 2} (see st_extensions.unierf_columns), or pass "
            "columns=train.column_names"
        )

    # ---------------------------------------------------------------- the terms

    def embed(
        self, sentence_features: Iterable[dict[str, Tensor]]
    ) -> tuple[dict[str, Tensor], Tensor, list[Tensor], list[str | None]]:
        """``(H per anchor branch (B, dim), positives (B, dim), negatives [(B, dim)], negative tags)``, normalised."""
        features = list(sentence_features)
        anchors, tags = self._layout(len(features))
        k = len(anchors)
        branch_emb = {
            branch: self.head.embed(self.model(f)["sentence_embedding"], branch)
            for branch, f in zip(anchors, features[:k])
        }
        docs = [F.normalize(e, dim=-1) for e in embed_columns(self.model, features[k:], separate_first=False)]
        return branch_emb, docs[0], docs[1:], tags

    def terms_from_embeddings(
        self, branch_emb: dict[str, Tensor], positives: Tensor, negatives: Sequence[Tensor], tags: Sequence[str | None]
    ) -> dict[str, Tensor]:
        """The four terms of Eq. 32 from normalised embeddings (see the class docstring)."""
        batch = positives.shape[0]
        target = torch.arange(batch, device=positives.device)
        zero = positives.new_zeros(())
        out = {"positive": zero, "triplet": zero, "infonce": zero}
        for branch, h in branch_emb.items():
            cands = torch.cat([positives, *(n for n, t in zip(negatives, tags) if t is None or t == branch)], dim=0)
            scores = h @ cands.T  # (B, B * (1 + m_b)); column i is row i's positive
            pos = scores[target, target]
            out["positive"] = out["positive"] + (self.positive_threshold - pos).clamp_min(0.0).mean()
            if scores.shape[1] > 1:
                is_neg = torch.ones_like(scores, dtype=torch.bool)
                is_neg[target, target] = False
                hinge = (scores - pos[:, None] + self.triplet_margin).clamp_min(0.0)
                out["triplet"] = out["triplet"] + hinge[is_neg].mean()
            out["infonce"] = out["infonce"] + F.cross_entropy(scores / self.temperature, target)
        stacked = torch.stack([branch_emb[b] for b in self.head.branches if b in branch_emb], dim=1)
        out["diversity"] = diversity_loss(
            stacked, self.diversity_scale, self.diversity_margin, self.diversity_threshold
        )
        return out

    def loss_terms(self, sentence_features: Iterable[dict[str, Tensor]]) -> dict[str, Tensor]:
        """Every term of Eq. 32 (``positive``, ``triplet``, ``infonce``, ``diversity``), switched on or not."""
        return self.terms_from_embeddings(*self.embed(sentence_features))

    def forward(self, sentence_features: Iterable[dict[str, Tensor]], labels: Tensor | None = None) -> Tensor:
        terms = self.loss_terms(sentence_features)
        return torch.stack([terms[name] for name in TERMS if self.use[name]]).sum()

    def get_config_dict(self) -> dict[str, Any]:
        return {
            "columns": self.columns,
            "positive_threshold": self.positive_threshold,
            "triplet_margin": self.triplet_margin,
            "temperature": self.temperature,
            "diversity_scale": self.diversity_scale,
            "diversity_margin": self.diversity_margin,
            "diversity_threshold": self.diversity_threshold,
            **{f"use_{name}": value for name, value in self.use.items()},
        }

    @property
    def citation(self) -> str:
        return UNIERF_CITATION
