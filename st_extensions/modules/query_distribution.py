"""The pEBR query-distribution head: a query's embedding -> its relevant-item distribution parameters.

pEBR (Zhang et al., ``../shared/papers/pebr.md``) makes the law of the cosine similarity between a query and
its relevant items query dependent: a temperature tau_q for ExpNCE (Sec. 3.2.1) and BetaNCE (Sec. 3.2.2,
where alpha_g(q) = 1 / tau_q and beta_g = 1, Eq. 3), or a pair of Beta laws (alpha+, beta+) for relevant and
(alpha-, beta-) for irrelevant items in the maximum-likelihood formulation (Sec. 3.1).
"""

from __future__ import annotations

import math
from typing import Any, Literal

import torch
from torch import Tensor, nn

from st_extensions.modules.safetensors_module import SafetensorsModule

Family = Literal["exp", "beta", "beta_mle"]
FAMILIES: tuple[str, ...] = ("exp", "beta", "beta_mle")
OUTPUT_KEY = "query_distribution"


class QueryDistributionHead(SafetensorsModule):
    """Maps a query's pooled embedding to the parameters of its relevant-item cosine distribution.

    Every parameter is produced in log space and bounded by a scaled sigmoid,
    ``log theta = log lo + (log hi - log lo) * sigmoid(scale * (w . e + b))``, so it is finite and inside
    ``[lo, hi]`` whatever the embedding. The linear map starts at zero and its bias is set so every query
    starts at ``tau_init`` (``exp``/``beta``) or at (1 / tau_init, 1, 1, 1) (``beta_mle``: a BetaNCE-like
    relevant law and a uniform irrelevant law). ``scale`` multiplies the pre-activation (its parameters are
    divided by it) so that, under the trainer's small Adam learning rate, the head still moves: with Adam
    a parameter moves about one learning rate per step, and the pre-activation ``scale`` times that.

    Outputs ``features["query_distribution"]``, shape ``(batch, k)``: ``k = 1`` (tau_q) for ``exp`` and
    ``beta``; ``k = 4`` (alpha+, beta+, alpha-, beta-) for ``beta_mle``. The head runs only on the query
    path (``task="query"``, i.e. ``model.encode_query``); ``encode_document`` and plain ``encode`` skip it,
    so documents get the plain normalised embeddings. The pEBR losses call :meth:`distribution_params`
    on the anchor embeddings themselves, so training needs no ``router_mapping``.

    Args:
        in_features: dimension of the pooled embedding (e.g. 384 for all-MiniLM-L6-v2).
        family: ``"exp"`` (ExpNCE), ``"beta"`` (BetaNCE) or ``"beta_mle"`` (Sec. 3.1).
        tau_init: initial temperature (0.05 = the usual InfoNCE scale 20).
        tau_min, tau_max: bounds on tau_q (``exp``/``beta``).
        param_min, param_max: bounds on the Beta parameters (``beta_mle``).
        scale: pre-activation multiplier (see above).
    """

    config_keys: list[str] = [
        "in_features",
        "family",
        "tau_init",
        "tau_min",
        "tau_max",
        "param_min",
        "param_max",
        "scale",
    ]
    config_file_name = "config.json"
    #: learning rate of this module's parameters under :func:`pyterrier_prob.training.fine_tune` (the encoder keeps
    #: the trainer's); chosen on nfcorpus train/dev by ``benchmarks/recipe_search.py`` (README, training recipes)
    learning_rate: float = 3e-4
    forward_kwargs = {"task"}

    def __init__(
        self,
        in_features: int,
        family: Family = "beta",
        tau_init: float = 0.05,
        tau_min: float = 0.01,
        tau_max: float = 1.0,
        param_min: float = 0.01,
        param_max: float = 1000.0,
        scale: float = 20.0,
    ) -> None:
        super().__init__()
        if family not in FAMILIES:
            raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")
        if not (isinstance(in_features, int) and in_features > 0):
            raise ValueError(f"in_features must be a positive int, got {in_features!r}")
        for name, value in (
            ("tau_init", tau_init),
            ("tau_min", tau_min),
            ("tau_max", tau_max),
            ("param_min", param_min),
            ("param_max", param_max),
            ("scale", scale),
        ):
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be finite and > 0, got {value!r}")
        if not tau_min < tau_init < tau_max:
            raise ValueError(f"need tau_min < tau_init < tau_max, got {tau_min}, {tau_init}, {tau_max}")
        if family == "beta_mle" and not param_min < min(1.0, 1.0 / tau_init) <= max(1.0, 1.0 / tau_init) < param_max:
            raise ValueError(f"need param_min < 1/tau_init, 1 < param_max, got {param_min}, {param_max}")
        self.in_features = in_features
        self.family = family
        self.tau_init = float(tau_init)
        self.tau_min, self.tau_max = float(tau_min), float(tau_max)
        self.param_min, self.param_max = float(param_min), float(param_max)
        self.scale = float(scale)

        if family == "beta_mle":
            bounds = [(param_min, param_max)] * 4
            init = [1.0 / tau_init, 1.0, 1.0, 1.0]
        else:
            bounds = [(tau_min, tau_max)]
            init = [tau_init]
        self.register_buffer("log_lo", torch.tensor([math.log(lo) for lo, _ in bounds]), persistent=False)
        self.register_buffer("log_hi", torch.tensor([math.log(hi) for _, hi in bounds]), persistent=False)
        self.linear = nn.Linear(in_features, len(init))
        with torch.no_grad():
            self.linear.weight.zero_()
            for i, ((lo, hi), value) in enumerate(zip(bounds, init)):
                frac = (math.log(value) - math.log(lo)) / (math.log(hi) - math.log(lo))
                self.linear.bias[i] = math.log(frac / (1.0 - frac)) / self.scale

    @property
    def num_params(self) -> int:
        """Number of distribution parameters per query (1 for exp/beta, 4 for beta_mle)."""
        return self.linear.out_features

    def distribution_params(self, embeddings: Tensor) -> Tensor:
        """Distribution parameters, shape ``(batch, num_params)``, for pooled query embeddings ``(batch, dim)``."""
        if embeddings.ndim != 2 or embeddings.shape[-1] != self.in_features:
            raise ValueError(
                f"QueryDistributionHead expects embeddings of shape (batch, {self.in_features}), "
                f"got {tuple(embeddings.shape)}: the head was built for another embedding dimension"
            )
        pre = self.scale * self.linear(embeddings.to(self.linear.weight.dtype))
        return torch.exp(self.log_lo + (self.log_hi - self.log_lo) * torch.sigmoid(pre))

    def temperature(self, embeddings: Tensor) -> Tensor:
        """tau_q, shape ``(batch,)``: the head's output for ``exp``/``beta``; 1 / alpha+ for ``beta_mle``."""
        params = self.distribution_params(embeddings)
        return params[:, 0] if self.family != "beta_mle" else 1.0 / params[:, 0]

    def forward(self, features: dict[str, Tensor | Any], task: str | None = None, **kwargs) -> dict[str, Any]:
        if (task or features.get("task")) == "query":
            features[OUTPUT_KEY] = self.distribution_params(features["sentence_embedding"])
        return features

    def __repr__(self) -> str:
        return (
            f"QueryDistributionHead(in_features={self.in_features}, family={self.family!r}, "
            f"tau_init={self.tau_init}, scale={self.scale})"
        )
