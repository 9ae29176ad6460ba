"""UniERF's multi-branch query tower: one head per retrieval branch on a shared encoder, saved inside the model.

UniERF (Jiang et al., KDD'25, ``../shared/papers/unierf.md``) serves several embedding-based retrieval
branches from one jointly trained user-query tower (Sec. 4.1; Alg. 1 lines 5-18): each branch reads its own
input and has its own aggregation network ``f`` ending in an L2 normalisation,
``H^branch = l2_norm(f(e))`` (Eq. 4-5, 13, 17), while the item tower is shared (Sec. 4.2).

Adapted to text retrieval, a branch is a head on the shared encoder's pooled embedding of the branch's own
input text (semantic: the query; trigger: the query and the text of a document the user looks at; context:
the query and other query fields), and the document tower is the encoder's plain document path, so the
documents are embedded and indexed once for all branches.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from st_extensions.modules.safetensors_module import SafetensorsModule

#: ``features`` key written on the query path: ``(batch, n_branches, dim)``, every row L2-normalised.
BRANCH_EMBEDDINGS_KEY = "branch_embeddings"
#: Branch names used by UniERF's training columns (``anchor_<branch>``, ``negative_<branch>``) must not be
#: this word, which names the shared random-negative column ``negative_random``.
RESERVED_BRANCH_NAMES: tuple[str, ...] = ("random",)
_BRANCH_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9]*$")


def check_branch_names(branches: Sequence[str]) -> list[str]:
    """Validate branch names: a non-empty sequence of distinct alphanumeric names starting with a letter.

    Underscores are refused because a branch's training columns are ``anchor_<branch>`` / ``negative_<branch>``
    and the sentence-transformers trainer tells columns apart by their name prefix (``anchor_a_`` would also
    match the features of a column ``anchor_a_b``); ``"random"`` is reserved for the ``negative_random`` column.

    Returns:
        The names as a list.
    """
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
    """One head per UniERF retrieval branch on the shared encoder's pooled query embedding (Sec. 4.1, Eq. 4-5).

    Branch b maps the pooled embedding e of *its own input text* to ``H^b = l2_norm(W_b e + c_b)``, a
    ``dim -> dim`` linear map, so every branch lands in the space of the (shared, unprojected) document
    embeddings and all branches search one index. The paper's aggregation network
    ``f = ReLU(LayerNorm(W x + b))`` (Eq. 4) is also applied to its items (Eq. 19); since the document tower
    here is the encoder's plain document path, the ReLU (which would confine queries to the positive orthant)
    and the LayerNorm are dropped. Each ``W_b`` starts at the identity plus seeded Gaussian noise of standard
    deviation ``init_std``: every branch starts as the base model's query embedding (a good retriever), and
    the noise breaks the symmetry between branches that read the same text, which the diversity loss (Eq. 31)
    could not otherwise separate (the gradient of cos(a, b) vanishes at a = b).

    On the query path (``task="query"``, e.g. ``model.encode_query``) the module writes
    ``features["branch_embeddings"]``, ``(batch, n_branches, dim)``: every branch's head applied to the
    batch's pooled embedding (pick row b for texts built for branch b). With ``branch="<name>"`` (a forward
    kwarg: ``model.encode_query(texts, branch="trigger")``) it also replaces ``sentence_embedding`` by that
    branch's embedding. Without ``branch``, ``sentence_embedding`` stays the base model's pooled embedding,
    and on the document path (``encode_document``) nothing changes. :class:`~st_extensions.losses.UniERFLoss`
    calls :meth:`embed` on the anchors' pooled embeddings itself, so training needs no ``router_mapping``.

    Args:
        in_features: dimension of the pooled embedding (e.g. 384 for all-MiniLM-L6-v2).
        branches: the branch names, in order (e.g. ``["semantic", "trigger"]``); see :func:`check_branch_names`.
        init_std: standard deviation of the noise added to the identity at initialisation.
        seed: seeds that noise.
        residual: parameterise each head as ``W_b = I + V_b`` with ``V_b`` starting at the noise (zero plus
            noise): the same map at initialisation, but the parameters measure the departure from the base
            embedding (what the frozen recipe trains; saved models without this key load as before).
    """

    config_keys: list[str] = ["in_features", "branches", "init_std", "seed", "residual"]
    config_file_name = "config.json"
    #: learning rate of this module's parameters under :func:`pyterrier_prob.training.fine_tune` (the encoder keeps
    #: the trainer's); chosen on nfcorpus train/dev by ``benchmarks/recipe_search.py`` (README, training recipes)
    learning_rate: float = 3e-4
    forward_kwargs = {"task", "branch"}

    def __init__(
        self, in_features: int, branches: Sequence[str], init_std: float = 0.01, seed: int = 0, residual: bool = False
    ) -> None:
        super().__init__()
        if isinstance(in_features, bool) or not isinstance(in_features, int) or in_features <= 0:
            raise ValueError(f"in_features must be a positive int, got {in_features!r}")
        if not (isinstance(init_std, (int, float)) and math.isfinite(init_std) and init_std >= 0):
            raise ValueError(f"init_std must be finite and >= 0, got {init_std!r}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"seed must be an int, got {seed!r}")
        self.in_features = in_features
        self.branches = check_branch_names(branches)
        self.init_std = float(init_std)
        self.seed = seed
        self.residual = bool(residual)
        self.heads = nn.ModuleDict({name: nn.Linear(in_features, in_features) for name in self.branches})
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for head in self.heads.values():
                noise = torch.randn(in_features, in_features, generator=generator) * self.init_std
                head.weight.copy_(noise if self.residual else torch.eye(in_features) + noise)
                head.bias.zero_()

    @property
    def num_branches(self) -> int:
        """Number of branches."""
        return len(self.branches)

    def branch_index(self, branch: str) -> int:
        """Position of ``branch`` in :attr:`branches`; a clear error for an unknown name."""
        try:
            return self.branches.index(branch)
        except ValueError:
            raise ValueError(f"unknown branch {branch!r}: this model's branches are {self.branches}") from None

    def _check(self, embeddings: Tensor) -> Tensor:
        if not isinstance(embeddings, Tensor) or embeddings.ndim != 2 or embeddings.shape[-1] != self.in_features:
            shape = tuple(embeddings.shape) if isinstance(embeddings, Tensor) else type(embeddings).__name__
            raise ValueError(
                f"MultiBranchQueryEncoder expects pooled embeddings of shape (batch, {self.in_features}), got "
                f"{shape}: the branch heads were built for another embedding dimension"
            )
        weight = next(iter(self.heads.values())).weight
        return embeddings.to(weight.dtype)

    def embed(self, embeddings: Tensor, branch: str | None = None) -> Tensor:
        """Branch embeddings ``H^b = l2_norm(W_b e + c_b)`` (Eq. 5) of pooled embeddings ``(batch, dim)``.

        Args:
            embeddings: the shared encoder's pooled embeddings of the branch's input texts.
            branch: a branch name: returns ``(batch, dim)``; ``None``: every branch, ``(batch, n_branches, dim)``.
        """
        e = self._check(embeddings)
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
        if branch is not None:
            if task == "document":
                raise ValueError(
                    f"branch={branch!r} asks for a query branch on the document path: branches are query-side"
                )
            features["sentence_embedding"] = self.embed(features["sentence_embedding"], branch)
            return features
        if task == "query":
            features[BRANCH_EMBEDDINGS_KEY] = self.embed(features["sentence_embedding"])
        return features

    def __repr__(self) -> str:
        return f"MultiBranchQueryEncoder(in_features={self.in_features}, branches={self.branches})"
