"""VarCrossEncoder's variational information-bottleneck loss (``shared/papers/var-cross-encoder.md``, Sec. 3.3).

l = beta * KL(N(mu(t), Sigma(t)) || N(0, I)) + E_{z ~ N(mu, Sigma)}[-log q(y | z)]   (Eq. 10)

with the KL in closed form (Eq. 17) and the prediction term the binary cross-entropy of sigma(s), s = z^T W + b
(Eq. 18-19), estimated by Monte Carlo over reparameterised samples z = mu + Sigma^(1/2) eps (Eq. 5, 20-21).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from sentence_transformers import CrossEncoder
from sentence_transformers.util import batch_to_device
from torch import Tensor, nn

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
    """KL(N(mean, diag var) || N(0, I)) per row, in closed form (Eq. 17):
    1/2 [mu^T mu + tr Sigma - K - log |Sigma|], shape ``(batch,)`` for ``mean``, ``var`` of shape ``(batch, K)``."""
    return 0.5 * (mean.pow(2) + var - 1.0 - torch.log(var)).sum(dim=-1)


class VariationalBCELoss(nn.Module):
    """Binary cross-entropy on sampled VarCrossEncoder scores plus beta * KL to N(0, I) (Eq. 10, 17-21).

    For each (query, document, label) the model's :class:`~st_extensions.cross_encoder.VariationalHead`
    gives mu(t) and diag Sigma(t); the loss draws ``num_samples`` latents z = mu + Sigma^(1/2) eps (Eq. 5),
    scores each with the head's decoder s = z^T W + b (Eq. 8) and averages

        BCEWithLogits(s, y) over samples and pairs  +  beta * mean_pairs KL(N(mu, Sigma) || N(0, I)),

    the Monte Carlo estimate of Eq. 10 (Eq. 20-21 write the prediction term with a flipped sign; Eq. 10 and
    Alg. 1 minimise beta * compression + prediction loss, as here). With ``beta = 0``, one sample and
    Sigma -> 0 it is :class:`~sentence_transformers.cross_encoder.losses.BinaryCrossEntropyLoss` on mu^T W + b.

    Args:
        model: a :class:`~st_extensions.cross_encoder.VarCrossEncoder` (``build_var_cross_encoder``).
        beta: the information-bottleneck weight (Eq. 9-10); the paper sweeps 1e-9 to 1e-5 (Sec. 6, Fig. 6)
            and finds the best values around 1e-7 to 1e-6.
        num_samples: N, the Monte Carlo samples per pair (Eq. 20).
        pos_weight: weight of positive pairs, as in ``torch.nn.BCEWithLogitsLoss``.

    Requirements:
        1. The model ends in a :class:`~st_extensions.cross_encoder.VariationalHead`.
        2. (query, document) pairs with a label: 1 relevant, 0 not (or a probability in [0, 1]).

    Inputs:
        +-----------------------------------+------------------------------+-------------------------------+
        | Inputs                            | Labels                       | Number of Model Output Labels |
        +===================================+==============================+===============================+
        | (query, document) pairs           | 1 if relevant, 0 if not      | 1                             |
        +-----------------------------------+------------------------------+-------------------------------+

    Example:
        ::

            from datasets import Dataset
            from sentence_transformers.cross_encoder import CrossEncoderTrainer
            from st_extensions.cross_encoder import build_var_cross_encoder
            from st_extensions.losses import VariationalBCELoss

            model = build_var_cross_encoder(variant="MEANVAR")  # packaged all-MiniLM-L6-v2 backbone
            train = Dataset.from_dict({
                "query": ["what are pandas?", "what are pandas?"],
                "document": ["Pandas are a kind of bear.", "Pandas are a kind of fish."],
                "label": [1, 0],
            })
            loss = VariationalBCELoss(model, beta=1e-7, num_samples=1)
            CrossEncoderTrainer(model=model, train_dataset=train, loss=loss).train()
    """

    def __init__(
        self,
        model: CrossEncoder,
        beta: float = 1e-7,
        num_samples: int = 1,
        pos_weight: Tensor | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(model, CrossEncoder):
            raise ValueError(f"VariationalBCELoss expects a CrossEncoder (a VarCrossEncoder), got {type(model)}")
        self.head = find_var_head(model)
        if not (isinstance(beta, (int, float)) and math.isfinite(beta) and beta >= 0):
            raise ValueError(f"beta must be a finite number >= 0, got {beta!r}")
        if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1:
            raise ValueError(f"num_samples must be a positive int, got {num_samples!r}")
        self.model = model
        self.beta = float(beta)
        self.num_samples = num_samples
        self.pos_weight = pos_weight
        self.bce_with_logits_loss = nn.BCEWithLogitsLoss(pos_weight=pos_weight)

    def forward(
        self, inputs: list[list[str]], labels: Tensor, prompt: str | None = None, task: str | None = None
    ) -> Tensor:
        if len(inputs) != 2:
            raise ValueError(
                f"VariationalBCELoss expects a dataset with two non-label columns (query, document), "
                f"got {len(inputs)} columns"
            )
        labels = self._check_batch(inputs, labels)
        pairs = list(zip(inputs[0], inputs[1]))
        features = self.model.preprocess(pairs, prompt=prompt, task=task)
        features = batch_to_device(features, self.model.device)
        outputs = self.model(features)
        mean, var = outputs[MEAN_KEY], outputs[VAR_KEY]
        if labels.numel() != mean.shape[0]:
            raise ValueError(
                f"VariationalBCELoss expects {mean.shape[0]} labels (one per pair), got {labels.numel()} "
                f"with shape {tuple(labels.shape)}"
            )
        z = self.head.sample(mean, var, self.num_samples)  # (N, B, K), Eq. 5
        scores = self.head.decode(z).squeeze(-1)  # (N, B), Eq. 8
        targets = labels.view(1, -1).to(scores.dtype).expand_as(scores)
        prediction = self.bce_with_logits_loss(scores, targets)  # Eq. 18-19, averaged over the N samples
        if self.beta == 0.0:
            return prediction
        return prediction + self.beta * gaussian_kl(mean, var).mean()  # Eq. 17

    @staticmethod
    def _check_batch(inputs: list[list[str]], labels: Any) -> Tensor:
        """Clear errors for an empty batch, missing or non-numeric labels, and texts that are not str."""
        n = len(inputs[0])
        if n == 0:
            raise ValueError(
                "VariationalBCELoss got an empty batch (0 rows: no (query, document) pairs): nothing to train on"
            )
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
        if not (
            labels.is_floating_point()
            or labels.dtype in (torch.bool, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)
        ):
            raise ValueError(f"VariationalBCELoss labels must be numbers in [0, 1], got dtype {labels.dtype}")
        values = labels.detach().float()
        bad = ~torch.isfinite(values) | (values < 0) | (values > 1)
        if bool(bad.any()):
            i = int(torch.nonzero(bad.reshape(-1))[0])
            raise ValueError(
                f"VariationalBCELoss labels must be numbers in [0, 1] (1 relevant, 0 not), got "
                f"{values.reshape(-1)[i].item()!r} for pair {i}"
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

    @property
    def citation(self) -> str:
        return VARCE_CITATION


class VariationalMarginMSELoss(nn.Module):
    """Margin-MSE distillation of a VarCrossEncoder (Hofstätter et al., 2020) with the variational head kept.

    For a query and documents ``d_0, d_1, ..., d_n`` with teacher scores ``t_0, ..., t_n``, the head gives each pair's
    score moments E[s_j] = mu_j^T W + b and Var[s_j] = W^T Sigma_j W (Eq. 22-23). The loss is

        mean_j (E[s_0] - E[s_j] - (t_0 - t_j))^2                                   (Margin-MSE on E[s], as the CE)
        + nll_weight * mean_j NLL(t_0 - t_j | N(E[s_0] - E[s_j], Var[s_0] + Var[s_j]))   (the margin's likelihood)
        + beta * mean_pairs KL(N(mu, Sigma) || N(0, I))                               (Eq. 10, 17)

    The first term trains the ranking exactly as sentence-transformers' ``MarginMSELoss`` trains a plain
    cross-encoder. The second is the teacher margin's Gaussian log-likelihood under the model's own score
    distribution (the latents integrated out in closed form, Eq. 22-23), with the mean and the decoder W detached: it
    trains only the variance, which so grows where the student cannot follow the teacher and shrinks where it can.
    A sampled-score data term with a fixed observation noise (Eq. 10 with a Gaussian or, to second order, a BCE
    likelihood) has an optimal Sigma that does not depend on the pair, which is why it learns a near-constant std[s].

    Args:
        model: a :class:`~st_extensions.cross_encoder.VarCrossEncoder`.
        beta: weight of the KL term (Eq. 10).
        nll_weight: weight of the margin's likelihood term.

    Requirements:
        1. The model ends in a :class:`~st_extensions.cross_encoder.VariationalHead`.
        2. Teacher scores for every document of a row.

    Inputs:
        +------------------------------------------------+----------------------------------------+
        | Inputs                                         | Labels                                 |
        +================================================+========================================+
        | (query, document_0, document_1, ..., document_n) | [t(q, d_0), t(q, d_1), ..., t(q, d_n)] |
        +------------------------------------------------+----------------------------------------+

    Example:
        ::

            from datasets import Dataset
            from sentence_transformers.cross_encoder import CrossEncoderTrainer
            from st_extensions.cross_encoder import build_var_cross_encoder
            from st_extensions.losses import VariationalMarginMSELoss

            model = build_var_cross_encoder(variant="MEANVAR")
            train = Dataset.from_dict({
                "query": ["what are pandas?"],
                "document_0": ["Pandas are a kind of bear."],
                "document_1": ["Pandas are a kind of fish."],
                "label": [[2.1, -0.4]],
            })
            CrossEncoderTrainer(model=model, train_dataset=train, loss=VariationalMarginMSELoss(model)).train()
    """

    def __init__(self, model: CrossEncoder, beta: float = 1e-7, nll_weight: float = 1.0) -> None:
        super().__init__()
        if not isinstance(model, CrossEncoder):
            raise ValueError(f"VariationalMarginMSELoss expects a VarCrossEncoder, got {type(model)}")
        self.head = find_var_head(model)
        for name, value in (("beta", beta), ("nll_weight", nll_weight)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        self.model = model
        self.beta = float(beta)
        self.nll_weight = float(nll_weight)

    def moments(self, pairs: list[tuple[str, str]], prompt: str | None = None, task: str | None = None) -> tuple:
        """(E[s], Var[s] with W detached, KL per pair) of ``pairs``, each ``(batch,)``."""
        features = batch_to_device(self.model.preprocess(pairs, prompt=prompt, task=task), self.model.device)
        out = self.model(features)
        mean, var = out[MEAN_KEY], out[VAR_KEY]
        w = self.head.decoder.weight.detach()
        return self.head.decoder(mean).view(-1), (var @ (w * w).T).view(-1), gaussian_kl(mean, var)

    def forward(
        self, inputs: list[list[str]], labels: Tensor, prompt: str | None = None, task: str | None = None
    ) -> Tensor:
        if len(inputs) < 3:
            raise ValueError(
                f"VariationalMarginMSELoss expects (query, document_0, document_1, ...) columns, got {len(inputs)}"
            )
        n = len(inputs[0])
        if n == 0:
            raise ValueError("VariationalMarginMSELoss got an empty batch (0 rows): nothing to train on")
        labels = torch.stack(labels) if isinstance(labels, list) else torch.as_tensor(labels)
        if labels.shape != (n, len(inputs) - 1):
            raise ValueError(
                f"VariationalMarginMSELoss expects labels of shape {(n, len(inputs) - 1)} (a teacher score per "
                f"document), got {tuple(labels.shape)}"
            )
        labels = labels.to(self.model.device).float()
        moments = [self.moments(list(zip(inputs[0], docs)), prompt, task) for docs in inputs[1:]]
        mean = torch.stack([m[0] for m in moments], dim=1)  # (B, n+1)
        var = torch.stack([m[1] for m in moments], dim=1)
        kl = torch.stack([m[2] for m in moments], dim=1)
        margin = mean[:, :1] - mean[:, 1:]
        target = labels[:, :1] - labels[:, 1:]
        loss = (margin - target).pow(2).mean()
        if self.nll_weight:
            spread = (var[:, :1] + var[:, 1:]).clamp_min(1e-8)
            residual = (margin.detach() - target).pow(2)
            loss = loss + self.nll_weight * 0.5 * (residual / spread + torch.log(spread)).mean()
        if self.beta:
            loss = loss + self.beta * kl.mean()
        return loss

    def get_config_dict(self) -> dict[str, Any]:
        return {"beta": self.beta, "nll_weight": self.nll_weight}

    @property
    def citation(self) -> str:
        return VARCE_CITATION
