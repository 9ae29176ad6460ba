"""The options of ``pyterrier-prob varce`` (:class:`VarceJobConfig`) and the defaults that depend on them: which recipe
runs, the students' joint layers and the dev points (:mod:`pyterrier_prob.experiments.varce` runs them)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from pyterrier_prob.experiments.options import CommonConfig, option

__all__ = ["NEGATIVE_SOURCES", "NOISE_ORDER", "RECIPE_DEFAULTS", "TRAIN_LAYERS", "VarceJobConfig", "dev_every"]

#: The students' joint (and trained) top layers when ``--train-layers`` is not given.
TRAIN_LAYERS = 1
#: The query perturbations of the robustness table (Table 4; docs/varce.md explains the codes).
NOISE_ORDER = ("RD", "RS", "SE", "SR", "WEI", "WES")
#: The first stages ``--negatives-from`` mines the label recipe's training negatives from.
NEGATIVE_SOURCES = ("bm25", "dense")
_ROBUST, _DEV, _OOD = "robustness (Table 4)", "learning curve and choices on dev", "zero-shot collections"
_DISTIL = "distillation (--teacher)"
#: The training options' defaults when the run distils (the default) and under the label recipe (``--teacher none``).
RECIPE_DEFAULTS = {
    True: {"recipe": "partial", "steps": 50, "batch_size": 16, "lr": 1e-4, "train_layers": TRAIN_LAYERS},
    False: {"recipe": "frozen", "steps": 1000, "batch_size": 64, "lr": 5e-5, "train_layers": None},
}


def _defaults(distils: bool) -> str:
    return " ".join(
        f"--{k.replace('_', '-')} {v:g}" if not isinstance(v, str) else f"--{k} {v}"
        for k, v in RECIPE_DEFAULTS[distils].items()
        if v is not None
    )


@dataclass
class VarceJobConfig(CommonConfig):
    """The ``pyterrier-prob varce`` options beyond :class:`CommonConfig`'s, each field's help its documentation."""

    output: str = "outputs/varce"
    recipe: str | None = None  # check(): RECIPE_DEFAULTS, by whether the run distils
    steps: int | None = None
    batch_size: int | None = None
    lr: float | None = None
    negatives: int = option(3, "negatives per relevant training doc, mined from --negatives-from")
    pool_depth: int = option(30, "depth of the first stages' rankings the negatives come from")
    beta: float = option(1e-7, "KL weight of VariationalBCELoss (Eq. 10)")
    depth: int = option(20, "BM25 candidates re-ranked per test query")
    max_queries: int | None = option(None, "seeded cap on test queries (None: all)")
    risks: Sequence[float] = option((0.0, 0.5, 1.0, 2.0), "lambda of the risk-aware E[s] - lambda*std[s]")
    robust_queries: int = option(20, "seeded test queries (0: skip)", _ROBUST)
    robust_depth: int = option(10, "BM25 depth per perturbed query", _ROBUST)
    noise: Sequence[str] = option(
        NOISE_ORDER, "perturbations (docs/varce.md explains the codes)", _ROBUST, choices=NOISE_ORDER
    )
    ood: Sequence[str] = option(
        (), "further collections to evaluate zero-shot (test split), e.g. irds:beir/scifact", _OOD, type=str, nargs="*"
    )
    ood_queries: int = option(60, "seeded query cap per --ood collection (0: every query)", _OOD)
    ood_depth: int = option(20, "BM25 depth re-ranked per --ood collection", _OOD)
    inference_batch_size: int = option(32, "pairs per forward pass")
    negatives_from: Sequence[str] = option(
        NEGATIVE_SOURCES,
        "first stages the training negatives are mined from, in turn (bm25; dense: the untrained base model as a "
        "bi-encoder)",
        choices=NEGATIVE_SOURCES,
    )
    extra_depths: Sequence[int] = option(
        (20,), "shallower depths also reported (the same scores, BM25's top k re-ranked)", nargs="*"
    )
    positive_depth: int | None = option(
        None, "positives only among the negative sources' top k (default: every judged-relevant document)"
    )
    dev_queries: int = option(
        100, "seeded dev queries of the learning curves and of the lambda/alpha choice (0: none)", _DEV
    )
    dev_depth: int = option(30, "BM25 depth re-ranked per dev query of the learning curves", _DEV)
    dev_every: int | None = option(None, "steps between dev points (default: steps/10; distilling: steps/2)", _DEV)
    teacher: str | None = option(
        "partial",
        "distil CE and VarCEs from this fine-tuned bi-encoder (a folder; 'partial': fine-tune one first, for "
        "--teacher-steps) fused with BM25, into split-attention students whose top --train-layers layers "
        "read both texts; 'none': the label recipe instead (heads trained on the judged labels). The training "
        f"options' defaults follow: {_defaults(True)}; under 'none' {_defaults(False)}",
        _DISTIL,
    )
    teacher_steps: int = option(100, "--teacher partial: the teacher's training steps (best dev point kept)", _DISTIL)
    teacher_only: bool = option(
        False,
        "--teacher partial: train (or reuse) the teacher alone into --output and stop; other runs then read it as "
        "--teacher <output>/models/distill-teacher",
        _DISTIL,
    )
    teacher_layers: int = option(2, "--teacher partial: the teacher's top layers that train", _DISTIL)
    teacher_batch_size: int = option(32, "--teacher partial: the teacher's batch size (distinct queries)", _DISTIL)
    teacher_lr: float = option(5e-5, "--teacher partial: the teacher's learning rate", _DISTIL)
    teacher_dev_every: int = option(100, "--teacher partial: steps between the teacher's dev points", _DISTIL)
    bm25_train_depth: int = option(1000, "BM25 depth of the training pools (a candidate deeper scores 0)", _DISTIL)
    init_cross_bias: float = option(
        0.0,
        "the students' starting attention bias between the two texts' tokens (0: full joint attention from the "
        "start; negative values damp it)",
        _DISTIL,
    )
    score_scale: float = option(10.0, "the students' cosine scale", _DISTIL)
    teacher_units: str = option("z", "teacher scores: z-scores or students' units", _DISTIL, choices=("z", "student"))
    head_lr: float | None = option(None, "the students' score head's rate (default: its declared 1e-3)", _DISTIL)
    cross_bias_lr: float | None = option(None, "the students' cross-text attention bias's rate (0: fixed)", _DISTIL)
    score_from: str = option(
        "kernels",
        "what a student's score reads: kernels: a frozen copy of its top layers reading each text apart (the "
        "teacher's bi-encoder) plus a term of the joint layers whose weights start at 0, kernel pooling of each joint "
        "layer's token similarities (CEDR-KNRM), so a student starts as the bi-encoder and learns what reading the "
        "pair together adds; both: the same with the joint layers' pooled cosine as that term; joint: the cosine alone",
        _DISTIL,
        choices=("both", "kernels", "joint"),
    )
    mc_dropout: int = option(
        0,
        "forward passes with dropout on per query's top 10 pairs: the MC-dropout confidence of the selective "
        "prediction table (0: none, the default, as 8 passes over every test query cost minutes; the lower layers' "
        "states are cached, so dropout acts in the joint layers)",
        _DISTIL,
    )
    students: Sequence[str] = option(
        ("CE", "VarCE-VAR"),
        "the distilled students to train (an ablation may train the CE alone)",
        _DISTIL,
        choices=("CE", "VarCE-MEANVAR", "VarCE-VAR"),
    )
    input_score: bool = option(
        False,
        "also train a CE and a VarCE-VAR that read BM25's score as text before the document (Askari et al., ECIR "
        "2023), in rows of their own beside the plain students",
        _DISTIL,
    )
    pseudo_queries: Sequence[str] = option(
        (),
        "more training queries cut from the training collection's own documents (title, span: a span of words of "
        "the body), each with a pool labelled by the teacher; the document a query was cut from is left out of its "
        "pool (default: none)",
        _DISTIL,
        choices=("title", "span"),
    )

    @property
    def distils(self) -> bool:
        """Whether the run distils students from a teacher (the default) rather than training on the labels."""
        return self.teacher is not None and self.teacher != "none"

    def check(self) -> None:
        """Raise ``ValueError`` naming the first setting out of range (as its command-line flag); the defaults that
        depend on the recipe (``--recipe``, ``--steps``) filled in."""
        distils = self.distils
        self.teacher = self.teacher if distils else None
        for name, value in RECIPE_DEFAULTS[distils].items():
            if getattr(self, name) is None:
                setattr(self, name, value)
        if self.dev_every is None and self.steps:  # dev_every's rule, shown in the run's settings
            self.dev_every = dev_every(self)
        super().check()
        lowest = {"negatives": 1, "pool_depth": 1, "depth": 1, "max_queries": 1, "robust_queries": 0}
        lowest |= {"robust_depth": 1, "ood_queries": 0, "ood_depth": 1, "inference_batch_size": 1}
        lowest |= {"positive_depth": 1, "dev_queries": 0, "dev_depth": 1}  # --dev-every: CommonConfig.check
        lowest |= {"teacher_steps": 1, "teacher_layers": 1, "teacher_batch_size": 2, "teacher_dev_every": 1}
        lowest |= {"bm25_train_depth": 1, "mc_dropout": 0}
        for name, low in lowest.items():
            value = getattr(self, name)
            if value is not None and value < low:
                raise ValueError(f"--{name.replace('_', '-')} must be >= {low}, got {value}")
        if not self.negatives_from:
            raise ValueError(f"--negatives-from: choose from {list(NEGATIVE_SOURCES)}, got []")
        if any(d < 1 for d in self.extra_depths):
            raise ValueError(f"--extra-depths must be >= 1, got {list(self.extra_depths)}")
        if self.pool_depth < self.negatives:
            raise ValueError(f"--pool-depth ({self.pool_depth}) must be at least --negatives ({self.negatives})")
        for name in ("beta", "cross_bias_lr", "teacher_lr", "score_scale", "head_lr"):  # the first two may be 0
            value, op = getattr(self, name), ">=" if name in ("beta", "cross_bias_lr") else ">"
            if value is not None and not (math.isfinite(value) and (value >= 0 if op == ">=" else value > 0)):
                raise ValueError(f"--{name.replace('_', '-')} must be a finite number {op} 0, got {value}")
        if not math.isfinite(self.init_cross_bias):
            raise ValueError(f"--init-cross-bias must be finite, got {self.init_cross_bias}")
        if not self.risks or any(not math.isfinite(r) for r in self.risks):
            raise ValueError(f"--risks must be finite numbers, got {list(self.risks)}")
        if self.mc_dropout == 1:
            raise ValueError("--mc-dropout needs at least 2 passes for a spread (0: none), got 1")
        if self.teacher_only and self.teacher != "partial":
            given = self.teacher or "none"
            raise ValueError(f"--teacher-only trains --teacher partial's bi-encoder, not --teacher {given}")
        if self.input_score and not self.teacher:
            raise ValueError("--input-score trains distilled students that read BM25's score: not under --teacher none")
        if tuple(self.students) != type(self)().students and not self.teacher:
            raise ValueError("--students chooses distilled students: not under --teacher none")
        if len(set(self.students)) != len(self.students):
            raise ValueError(f"--students names a student twice: {list(self.students)}")
        if self.pseudo_queries and not self.teacher:
            raise ValueError("--pseudo-queries trains distilled students: not under --teacher none")
        if len(set(self.pseudo_queries)) != len(self.pseudo_queries):
            raise ValueError(f"--pseudo-queries names a kind twice: {list(self.pseudo_queries)}")
        if self.claims_json:  # (the option every experiment takes)
            raise ValueError("--claims-json: varce records no claims rows (its tables are in summary.json)")


def dev_every(cfg: VarceJobConfig) -> int:
    """Steps between dev points: ``--dev-every``, else a tenth of the steps (a distilling run: half of them, a short
    run's few dev points). The one rule: :meth:`VarceJobConfig.check` fills the option from it."""
    return cfg.dev_every or max(1, cfg.steps // (2 if cfg.distils else 10))
