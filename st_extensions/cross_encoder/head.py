"""The VarCrossEncoder head (``shared/papers/var-cross-encoder.md``, Sec. 3.2): the [CLS] embedding t -> a diagonal
Gaussian over a K-dimensional latent (Eq. 3; modules ``VAR``: mu = [CLS], ``MEANVAR``: both learned, ``MEAN``: Sigma
read off [CLS]) -> a linear score s = z^T W (+ b) (Eq. 7-8), sampled in training, in closed form at inference."""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch import Tensor, nn

from st_extensions.checks import finite_float, positive_int
from st_extensions.modules.safetensors_module import SafetensorsModule

Variant = Literal["VAR", "MEANVAR", "MEAN"]
VARIANTS: tuple[str, ...] = ("VAR", "MEANVAR", "MEAN")
MEAN_KEY = "latent_mean"
VAR_KEY = "latent_var"
SCORE_VAR_KEY = "score_var"


class VariationalHead(SafetensorsModule):
    """Probabilistic module + linear ranker of VarCrossEncoder (Sec. 3.2.1-3.2.2, Eq. 3-8, 22-23): reads the [CLS]
    embedding t and writes ``latent_mean`` / ``latent_var`` (mu(t), diag Sigma(t), ``(batch, K)``),
    ``scores`` (training: a reparameterised sample ``(mu + Sigma^(1/2) eps)^T W + b``, Eq. 5, 8; eval: ``mu^T W + b``,
    Eq. 22) and ``score_var`` (``W^T Sigma W``, Eq. 23). log Sigma (in ``MEAN`` the embedding itself) is clamped to
    ``[min_log_var, max_log_var]``; the variance branch starts at zero weights and bias ``init_log_var`` (Sigma = I).
    ``variant``: ``"VAR"``, ``"MEANVAR"`` or ``"MEAN"``; ``latent_dim`` K must equal ``in_features`` except for
    ``MEANVAR``; ``bias``: a decoder bias (not in Eq. 8; lets BCE fit the base rate). ``mean_branch_rate``: the
    mean branch's learning rate as a multiple of the head's (:attr:`parameter_rate_scales`). The split students start
    their mean branch as the identity and set it to 1 / ``in_features``, so that E[s] moves per step as a linear
    head's does: Adam moves every weight by about the rate, and E[s]'s weight on a feature sums ``in_features`` of
    the branch's."""

    config_keys: list[str] = [
        "in_features", "variant", "latent_dim", "bias", "init_log_var", "min_log_var", "max_log_var",
        "module_input_name", "mean_branch_rate",
    ]  # fmt: skip
    #: this head's :attr:`SafetensorsModule.learning_rate` (chosen by ``benchmarks/recipe_search.py`` as the default)
    learning_rate: float = 1e-3

    def __init__(
        self,
        in_features: int,
        variant: Variant = "VAR",
        latent_dim: int | None = None,
        bias: bool = True,
        init_log_var: float = 0.0,
        min_log_var: float = -20.0,
        max_log_var: float = 10.0,
        module_input_name: str = "sentence_embedding",
        mean_branch_rate: float = 1.0,
    ) -> None:
        super().__init__()
        self.mean_branch_rate = finite_float("mean_branch_rate", mean_branch_rate, low=0.0)
        positive_int("in_features", in_features)
        canonical = str(variant).upper().replace("-", "").replace("_", "")
        canonical = {"VARM": "VAR", "MEANVARM": "MEANVAR", "MEANM": "MEAN"}.get(canonical, canonical)
        if canonical not in VARIANTS:
            raise ValueError(f"variant must be one of {VARIANTS} (the paper's VARM, MEANVARM, MEANM), got {variant!r}")
        variant = canonical
        latent_dim = positive_int("latent_dim", latent_dim, allow_none=True) or in_features
        if variant in ("VAR", "MEAN") and latent_dim != in_features:
            raise ValueError(
                f"the {variant} module uses [CLS] itself as the {'mean' if variant == 'VAR' else 'variance'}, "
                f"so latent_dim must equal in_features ({in_features}), got {latent_dim}; use MEANVAR for another K"
            )
        for name, value in (("init_log_var", init_log_var), ("min_log_var", min_log_var), ("max_log_var", max_log_var)):
            setattr(self, name, finite_float(name, value))
        if not min_log_var <= init_log_var <= max_log_var:
            raise ValueError(
                f"need min_log_var <= init_log_var <= max_log_var, got {min_log_var}, {init_log_var}, {max_log_var}"
            )
        self.in_features, self.variant, self.latent_dim, self.bias = in_features, variant, latent_dim, bool(bias)
        self.module_input_name = module_input_name

        self.mean_branch = nn.Linear(in_features, latent_dim) if variant in ("MEANVAR", "MEAN") else None
        self.var_branch = nn.Linear(in_features, latent_dim) if variant in ("VAR", "MEANVAR") else None
        if self.var_branch is not None:  # zero weights, log Sigma = init_log_var
            nn.init.zeros_(self.var_branch.weight)
            nn.init.constant_(self.var_branch.bias, self.init_log_var)
        self.decoder = nn.Linear(latent_dim, 1, bias=self.bias)

    @property
    def parameter_rate_scales(self) -> dict[str, float]:
        """Child module -> multiple of this head's rate (:func:`pyterrier_prob.training.head_learning_rates`)."""
        return {"mean_branch": self.mean_branch_rate} if self.mean_branch is not None else {}

    def distribution(self, cls_embedding: Tensor) -> tuple[Tensor, Tensor]:
        """``(mu, diag Sigma)``, each ``(batch, K)``, of p(z | t) (Eq. 3) for [CLS] embeddings ``(batch, d)``."""
        t = self._checked_embeddings(cls_embedding, self.in_features, "[CLS] embeddings")
        mean = t if self.mean_branch is None else self.mean_branch(t)
        log_var = t if self.var_branch is None else self.var_branch(t)
        return mean, torch.exp(log_var.clamp(self.min_log_var, self.max_log_var))

    def decode(self, z: Tensor) -> Tensor:
        """The ranker s = z^T W (+ b) (Eq. 8), shape ``(..., 1)`` for latents ``(..., K)``."""
        return self.decoder(z)

    def sample(self, mean: Tensor, var: Tensor, num_samples: int | None = None) -> Tensor:
        """Reparameterised latent samples z = mu + Sigma^(1/2) eps (Eq. 5): ``(batch, K)``, or
        ``(num_samples, batch, K)`` when ``num_samples`` is given."""
        shape = mean.shape if num_samples is None else (num_samples, *mean.shape)
        return mean + torch.sqrt(var) * torch.randn(shape, dtype=mean.dtype, device=mean.device)

    def score_moments(self, mean: Tensor, var: Tensor) -> tuple[Tensor, Tensor]:
        """E[s] = mu^T W + b (Eq. 22) and Var[s] = W^T Sigma W (Eq. 23), each ``(batch, 1)``."""
        w = self.decoder.weight  # (1, K)
        return self.decoder(mean), var @ (w * w).T

    def forward(self, features: dict[str, Tensor | Any], **kwargs) -> dict[str, Tensor | Any]:
        mean, var = self.distribution(features[self.module_input_name])
        expected, score_var = self.score_moments(mean, var)
        features.update({MEAN_KEY: mean, VAR_KEY: var, SCORE_VAR_KEY: score_var})
        features["scores"] = self.decode(self.sample(mean, var)) if self.training else expected
        return features

    def __repr__(self) -> str:
        return (
            f"VariationalHead(in_features={self.in_features}, variant={self.variant!r}, "
            f"latent_dim={self.latent_dim}, bias={self.bias})"
        )
