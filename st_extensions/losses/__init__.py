"""sentence-transformers losses, one module per paper."""

from st_extensions.losses.mol import MoLLoss
from st_extensions.losses.pebr import BetaMLELoss, BetaNCELoss, ExpNCELoss

__all__ = ["BetaMLELoss", "BetaNCELoss", "ExpNCELoss", "MoLLoss"]
