"""VarCrossEncoder's variational information-bottleneck loss (``shared/papers/var-cross-encoder.md``, Sec. 3.3).

l = beta * KL(N(mu(t), Sigma(t)) || N(0, I)) + E_{z ~ N(mu, Sigma)}[-log q(y | z)]   (Eq. 10)

with the KL in closed form (Eq. 17) and the prediction term the binary cross-entropy of sigma(s), s = z^T W + b
(Eq. 18-19), estimated by Monte Carlo over reparameterised samples z = mu + Sigma^(1/2) eps (Eq. 5, 20-21).
"""

from __future__ import annotations

from typing import Any

import torch
from sentence_transformers import CrossEncoder
from sentence_transformers.util import batch_to_device
from torch import Tensor, nn

from st_extensions.checks import finite_float, positive_int
from st_extensions.cross_encoder.head import MEAN_KEY, VAR_KEY
from st_extensions.cross_encoder.model import find_var_head

VARCE_CITATION = """
@misc{khodabakhsh_bagheri_varcrossencoder,
    title={Learning to Rank Under Uncertainty: A Robust Neural Approach},
    author={Maryam Khodabakhsh and Ebrahim Bagheri},
    note={VarCrossEncoder},
}
"""


def gaussian_kl(mean: Tensor, var: Tensor) -> Tensor:
    """KL(N(mean, diag var) || N(0, I)) per row in closed form (Eq. 17): 1/2 [mu^T mu + tr Sigma - K - log |Sigma|]."""
    return 0.5 * (mean.pow(2) + var - 1.0 - torch.log(var)).sum(dim=-1)


class _VarCELoss(nn.Module):
    """Shared set-up of the VarCrossEncoder losses: the model's VariationalHead and the KL weight beta (Eq. 10)."""

    citation = VARCE_CITATION

    def __init__(self, model: CrossEncoder, beta: float) -> None:
        super().__init__()
        if not isinstance(model, CrossEncoder):
            raise ValueError(f"{type(self).__name__} expects a CrossEncoder (a VarCrossEncoder), got {type(model)}")
        self.head, self.model = find_var_head(model), model
        self.beta = finite_float("beta", beta, low=0.0)

    def latents(
        self, pairs: list[tuple[str, str]], prompt: str | None = None, task: str | None = None
    ) -> tuple[Tensor, Tensor]:
        """``(mu, diag Sigma)`` of the model's Gaussian latent (Eq. 3) for each pair, each ``(batch, K)``."""
        out = self.model(batch_to_device(self.model.preprocess(pairs, prompt=prompt, task=task), self.model.device))
        return out[MEAN_KEY], out[VAR_KEY]


class VariationalBCELoss(_VarCELoss):
    """Binary cross-entropy on sampled VarCrossEncoder scores plus beta * KL to N(0, I) (Eq. 10, 17-21).

    Draws ``num_samples`` latents z = mu + Sigma^(1/2) eps (Eq. 5) per (query, document) pair, scores them with the
    head's decoder s = z^T W + b (Eq. 8) and averages BCEWithLogits(s, y) (``pos_weight`` as in torch) + beta * mean KL.
    Labels: 1 relevant, 0 not, or a probability. Beta range and an example: ``docs/varce.md``."""

    def __init__(
        self, model: CrossEncoder, beta: float = 1e-7, num_samples: int = 1, pos_weight: Tensor | None = None
    ) -> None:
        super().__init__(model, beta)
        self.num_samples = positive_int("num_samples", num_samples)
        self.pos_weight = pos_weight
        self.bce_with_logits_loss = nn.BCEWithLogitsLoss(pos_weight=pos_weight)

    def forward(
        self, inputs: list[list[str]], labels: Tensor, prompt: str | None = None, task: str | None = None
    ) -> Tensor:
        labels = self._check_batch(inputs, labels)
        mean, var = self.latents(list(zip(*inputs)), prompt, task)
        z = self.head.sample(mean, var, self.num_samples)  # (N, B, K), Eq. 5
        scores = self.head.decode(z).squeeze(-1)  # (N, B), Eq. 8
        targets = labels.view(1, -1).to(scores.dtype).expand_as(scores)
        prediction = self.bce_with_logits_loss(scores, targets)  # Eq. 18-19, averaged over the N samples
        return prediction + self.beta * gaussian_kl(mean, var).mean() if self.beta else prediction  # Eq. 17

    @staticmethod
    def _check_batch(inputs: list[list[str]], labels: Any) -> Tensor:
        """Clear errors for a wrong or empty batch, texts that are not str and missing or non-numeric labels."""
        if len(inputs) != 2:
            raise ValueError(f"VariationalBCELoss expects two non-label columns (query, document), got {len(inputs)}")
        n = len(inputs[0])
        if n == 0:
            raise ValueError("VariationalBCELoss got an empty batch (0 rows: no (query, document) pairs)")
        if len(inputs[1]) != n:
            raise ValueError(f"VariationalBCELoss got {n} queries but {len(inputs[1])} documents")
        for column, texts in zip(("query", "document"), inputs):
            for i, t in enumerate(texts):
                if not isinstance(t, str):
                    raise ValueError(
                        f"VariationalBCELoss: the {column} of pair {i} is {t!r} ({type(t).__name__}), not a str"
                    )
        if labels is None:
            raise ValueError(
                "VariationalBCELoss needs labels (1 if the document is relevant, 0 if not; or a probability), got "
                "None: give the dataset a 'label' column"
            )
        if not isinstance(labels, Tensor):
            try:
                labels = torch.as_tensor(labels, dtype=torch.float32)
            except (TypeError, ValueError, RuntimeError) as e:
                raise ValueError(f"VariationalBCELoss labels must be numbers in [0, 1], got {labels!r}") from e
        if labels.is_complex():
            raise ValueError(f"VariationalBCELoss labels must be numbers in [0, 1], got dtype {labels.dtype}")
        if labels.numel() != n:
            raise ValueError(f"VariationalBCELoss expects {n} labels (one per pair), got shape {tuple(labels.shape)}")
        values = labels.detach().float().reshape(-1)
        bad = torch.nonzero(~torch.isfinite(values) | (values < 0) | (values > 1))
        if len(bad):
            i = int(bad[0, 0])
            raise ValueError(
                f"VariationalBCELoss labels must be numbers in [0, 1], got {values[i].item()!r} for pair {i}"
            )
        return labels

    def get_config_dict(self) -> dict[str, Any]:
        return {
            "beta": self.beta,
            "num_samples": self.num_samples,
            "pos_weight": self.pos_weight if self.pos_weight is None else self.pos_weight.item(),
            "variant": self.head.variant,
            "latent_dim": self.head.latent_dim,
        }


class VariationalMarginMSELoss(_VarCELoss):
    """Margin-MSE distillation of a VarCrossEncoder (Hofstätter et al., 2020) with the variational head kept.

    With E[s_j] = mu_j^T W + b, Var[s_j] = W^T Sigma_j W (Eq. 22-23) and teacher scores t_j of row (q, d_0, ..., d_n):
    mean_j (E[s_0] - E[s_j] - (t_0 - t_j))^2 + nll_weight * mean_j NLL(t_0 - t_j | N(E[s_0] - E[s_j], Var[s_0] +
    Var[s_j])) + beta * mean KL (Eq. 10, 17). The NLL has the mean and W detached, so it trains only the variance (grows
    where the student misses the teacher); why not Eq. 10's sampled BCE: ``docs/varce.md``."""

    def __init__(self, model: CrossEncoder, beta: float = 1e-7, nll_weight: float = 1.0) -> None:
        super().__init__(model, beta)
        self.nll_weight = finite_float("nll_weight", nll_weight, low=0.0)

    def moments(self, pairs: list[tuple[str, str]], prompt: str | None = None, task: str | None = None) -> tuple:
        """(E[s], Var[s] with W detached, KL per pair) of ``pairs``, each ``(batch,)``."""
        mean, var = self.latents(pairs, prompt, task)
        w = self.head.decoder.weight.detach()
        return self.head.decoder(mean).view(-1), (var @ (w * w).T).view(-1), gaussian_kl(mean, var)

    def forward(
        self, inputs: list[list[str]], labels: Tensor, prompt: str | None = None, task: str | None = None
    ) -> Tensor:
        terms = self.terms(inputs, labels, prompt, task)
        loss = terms["margin_mse"]
        if self.nll_weight:
            loss = loss + self.nll_weight * terms["nll"]
        return loss + self.beta * terms["kl"] if self.beta else loss

    def terms(
        self, inputs: list[list[str]], labels: Tensor, prompt: str | None = None, task: str | None = None
    ) -> dict[str, Tensor]:
        """The loss's terms, unweighted: ``margin_mse``, ``nll`` (the teacher margin's Gaussian NLL, training the
        variance only) and ``kl`` (mean KL); :meth:`forward` is ``margin_mse + nll_weight * nll + beta * kl``."""
        if len(inputs) < 3:
            raise ValueError(
                f"VariationalMarginMSELoss expects (query, document_0, document_1, ...), got {len(inputs)}"
            )
        n = len(inputs[0])
        if n == 0:
            raise ValueError("VariationalMarginMSELoss got an empty batch (0 rows): nothing to train on")
        labels = torch.stack(labels) if isinstance(labels, list) else torch.as_tensor(labels)
        if labels.shape != (n, len(inputs) - 1):
            raise ValueError(
                f"VariationalMarginMSELoss expects labels of shape {(n, len(inputs) - 1)}, got {tuple(labels.shape)}"
            )
        labels = labels.to(self.model.device).float()
        moments = [self.moments(list(zip(inputs[0], docs)), prompt, task) for docs in inputs[1:]]
        mean, var, kl = (torch.stack(m, dim=1) for m in zip(*moments))  # each (B, n+1)
        margin = mean[:, :1] - mean[:, 1:]
        target = labels[:, :1] - labels[:, 1:]
        spread = (var[:, :1] + var[:, 1:]).clamp_min(1e-8)
        residual = (margin.detach() - target).pow(2)
        nll = 0.5 * (residual / spread + torch.log(spread)).mean()
        return {"margin_mse": (margin - target).pow(2).mean(), "nll": nll, "kl": kl.mean()}

    def get_config_dict(self) -> dict[str, Any]:
        return {"beta": self.beta, "nll_weight": self.nll_weight}
