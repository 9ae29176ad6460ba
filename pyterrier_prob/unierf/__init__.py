"""UniERF's PyTerrier side (``shared/papers/unierf.md``): the branch encoder, trigger text, the multi-branch retriever
with quota merging, and the training-data builder. The experiment is :mod:`pyterrier_prob.experiments.unierf`."""

from pyterrier_prob.unierf.branches import (
    MultiBranchRetriever,
    TriggerText,
    UniERFDataConfig,
    UniERFEncoder,
    branch_quotas,
    merge_branch_lists,
    unierf_training_data,
)

__all__ = [
    "MultiBranchRetriever",
    "TriggerText",
    "UniERFDataConfig",
    "UniERFEncoder",
    "branch_quotas",
    "merge_branch_lists",
    "unierf_training_data",
]
