"""UniERF's multi-branch query tower (Jiang et al., KDD'25, ``../shared/papers/unierf.md``, Sec. 4.1, Eqs. 4-5): one
head ``H^branch = l2_norm(f(e))`` per retrieval branch on a shared encoder, saved inside the model."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from st_extensions.checks import finite_float, is_int, positive_int
from st_extensions.modules.safetensors_module import SafetensorsModule

#: ``features`` key written on the query path: ``(batch, n_branches, dim)``, every row L2-normalised.
BRANCH_EMBEDDINGS_KEY = "branch_embeddings"
#: Branch names used by UniERF's training columns (``anchor_<branch>``, ``negative_<branch>``) must not be
#: this word, which names the shared random-negative column ``negative_random``.
RESERVED_BRANCH_NAMES: tuple[str, ...] = ("random",)
_BRANCH_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9]*$")


def check_branch_names(branches: Sequence[str]) -> list[str]:
    """The names as a list, checked: non-empty, distinct, alphanumeric, starting with a letter. No underscores: the
    trainer tells the columns ``anchor_<branch>`` apart by prefix (``anchor_a_`` would match ``anchor_a_b``)."""
    if isinstance(branches, str):
        raise ValueError(f"branches must be a sequence of names, got the string {branches!r}")
    names = list(branches)
    if not names:
        raise ValueError("need at least one branch")
    for name in names:
        if not isinstance(name, str) or not _BRANCH_NAME.match(name):
            raise ValueError(
                f"branch names must be alphanumeric and start with a letter (no underscores), got {name!r}"
            )
        if name in RESERVED_BRANCH_NAMES:
            raise ValueError(f"{name!r} is reserved (it names the shared negative_random column); pick another name")
    if len(set(names)) != len(names):
        raise ValueError(f"branch names must be distinct, got {names}")
    return names


class MultiBranchQueryEncoder(SafetensorsModule):
    """One head per UniERF retrieval branch on the shared encoder's pooled query embedding (Sec. 4.1, Eq. 4-5): ``H^b =
    l2_norm(W_b e + c_b)`` of the pooled embedding e of branch b's input text, ``W_b`` starting at the identity plus
    noise of std ``init_std`` (seeded; ``residual``: ``W_b = I + V_b``). The query path writes
    ``features["branch_embeddings"]`` ``(batch, n_branches, dim)``, or with ``branch="<name>"`` replaces
    ``sentence_embedding`` by that branch's; the document path is unchanged (``docs/unierf.md``)."""

    config_keys: list[str] = ["in_features", "branches", "init_std", "seed", "residual"]
    forward_kwargs = {"task", "branch"}

    def __init__(
        self, in_features: int, branches: Sequence[str], init_std: float = 0.01, seed: int = 0, residual: bool = False
    ) -> None:
        super().__init__()
        self.in_features = positive_int("in_features", in_features)
        self.init_std = finite_float("init_std", init_std, low=0.0)
        if not is_int(seed):
            raise ValueError(f"seed must be an int, got {seed!r}")
        self.branches = check_branch_names(branches)
        self.seed, self.residual = int(seed), bool(residual)
        self.heads = nn.ModuleDict({name: nn.Linear(in_features, in_features) for name in self.branches})
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for head in self.heads.values():
                noise = torch.randn(in_features, in_features, generator=generator) * self.init_std
                head.weight.copy_(noise if self.residual else torch.eye(in_features) + noise)
                head.bias.zero_()

    def branch_index(self, branch: str) -> int:
        """Position of ``branch`` in :attr:`branches`; a clear error for an unknown name."""
        try:
            return self.branches.index(branch)
        except ValueError:
            raise ValueError(f"unknown branch {branch!r}: this model's branches are {self.branches}") from None

    def embed(self, embeddings: Tensor, branch: str | None = None) -> Tensor:
        """``H^b = l2_norm(W_b e + c_b)`` (Eq. 5) of pooled embeddings ``(batch, dim)``: ``(batch, dim)`` for one
        ``branch``, ``(batch, n_branches, dim)`` for all (``None``)."""
        e = self._checked_embeddings(embeddings, self.in_features, "pooled embeddings")
        if branch is not None:
            self.branch_index(branch)
            return F.normalize(self._map(branch, e), dim=-1)
        return torch.stack([F.normalize(self._map(name, e), dim=-1) for name in self.branches], dim=1)

    def _map(self, branch: str, e: Tensor) -> Tensor:
        """``W_b e + c_b``; residual: ``e + V_b e + c_b`` (the same map with ``W_b = I + V_b``)."""
        out = self.heads[branch](e)
        return e + out if self.residual else out

    def forward(
        self, features: dict[str, Tensor | Any], task: str | None = None, branch: str | None = None, **kwargs
    ) -> dict[str, Any]:
        task = task or features.get("task")
        if branch is not None and task == "document":
            raise ValueError(f"branch={branch!r} asks for a query branch on the document path: branches are query-side")
        if branch is not None:
            features["sentence_embedding"] = self.embed(features["sentence_embedding"], branch)
        elif task == "query":
            features[BRANCH_EMBEDDINGS_KEY] = self.embed(features["sentence_embedding"])
        return features

    def __repr__(self) -> str:
        return f"MultiBranchQueryEncoder(in_features={self.in_features}, branches={self.branches})"
