"""The pEBR query-distribution head (Zhang et al., ``../shared/papers/pebr.md``): a query's embedding -> the law of
its relevant items' cosines: tau_q for ExpNCE (Sec. 3.2.1) and BetaNCE (Sec. 3.2.2, alpha_g(q) = 1 / tau_q,
beta_g = 1, Eq. 3), or Beta laws (alpha+, beta+), (alpha-, beta-) for the maximum-likelihood form (Sec. 3.1)."""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch import Tensor, nn

from st_extensions.checks import choice, positive_float, positive_int
from st_extensions.modules.safetensors_module import SafetensorsModule

Family = Literal["exp", "beta", "beta_mle"]
FAMILIES: tuple[str, ...] = ("exp", "beta", "beta_mle")
OUTPUT_KEY = "query_distribution"


class QueryDistributionHead(SafetensorsModule):
    """Maps a query's pooled embedding to the parameters of its relevant-item cosine distribution, each ``log theta =
    log lo + (log hi - log lo) * sigmoid(scale * (w . e + b))`` in ``[tau_min, tau_max]`` (``family`` ``"exp"`` /
    ``"beta"``: tau_q) or ``[param_min, param_max]`` (``"beta_mle"``: alpha+, beta+, alpha-, beta-); w starts at zero, b
    at ``tau_init`` (0.05 = InfoNCE's scale 20), resp. (1 / tau_init, 1, 1, 1); ``scale`` keeps the head moving under
    Adam's small steps. Writes ``features["query_distribution"]`` ``(batch, k)`` on the query path."""

    config_keys: list[str] = "in_features family tau_init tau_min tau_max param_min param_max scale".split()
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
        self.family = choice("family", family, FAMILIES)
        self.in_features = positive_int("in_features", in_features)
        for name, value in zip(self.config_keys[2:], (tau_init, tau_min, tau_max, param_min, param_max, scale)):
            setattr(self, name, positive_float(name, value))
        if not tau_min < tau_init < tau_max:
            raise ValueError(f"need tau_min < tau_init < tau_max, got {tau_min}, {tau_init}, {tau_max}")
        if family == "beta_mle" and not param_min < min(1.0, 1.0 / tau_init) <= max(1.0, 1.0 / tau_init) < param_max:
            raise ValueError(f"need param_min < 1/tau_init, 1 < param_max, got {param_min}, {param_max}")

        mle = family == "beta_mle"
        bounds = torch.tensor([(param_min, param_max)] * 4 if mle else [(tau_min, tau_max)], dtype=torch.float64).log()
        init = torch.tensor([1.0 / tau_init, 1.0, 1.0, 1.0] if mle else [tau_init], dtype=torch.float64).log()
        self.register_buffer("log_lo", bounds[:, 0].float(), persistent=False)
        self.register_buffer("log_hi", bounds[:, 1].float(), persistent=False)
        self.linear = nn.Linear(in_features, len(init))
        with torch.no_grad():  # w = 0 and b such that every query starts at ``init``
            self.linear.weight.zero_()
            self.linear.bias.copy_(torch.logit((init - bounds[:, 0]) / (bounds[:, 1] - bounds[:, 0])) / self.scale)

    @property
    def num_params(self) -> int:
        """Number of distribution parameters per query (1 for exp/beta, 4 for beta_mle)."""
        return self.linear.out_features

    def distribution_params(self, embeddings: Tensor) -> Tensor:
        """Distribution parameters, shape ``(batch, num_params)``, for pooled query embeddings ``(batch, dim)``."""
        pre = self.scale * self.linear(self._checked_embeddings(embeddings, self.in_features))
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
