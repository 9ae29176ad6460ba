"""sentence-transformers losses, one module per paper."""

from st_extensions.losses.mnrl import MaskedMultipleNegativesRankingLoss
from st_extensions.losses.mol import MoLLoss
from st_extensions.losses.pebr import BetaMLELoss, BetaNCELoss, ExpNCELoss
from st_extensions.losses.unierf import UniERFLoss
from st_extensions.losses.varce import VariationalBCELoss, VariationalMarginMSELoss

__all__ = [
    "BetaMLELoss",
    "BetaNCELoss",
    "ExpNCELoss",
    "MaskedMultipleNegativesRankingLoss",
    "MoLLoss",
    "UniERFLoss",
    "VariationalBCELoss",
    "VariationalMarginMSELoss",
]
