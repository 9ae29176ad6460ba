"""VarCrossEncoder (``shared/papers/var-cross-encoder.md``): a CrossEncoder with a Gaussian latent and score.

:class:`VariationalHead` is the probabilistic module + linear ranker (Sec. 3.2), :class:`VarCrossEncoder`
the CrossEncoder that holds it (``predict(..., return_std=True)``), :func:`build_var_cross_encoder` builds one
on a backbone; the loss is :class:`st_extensions.losses.VariationalBCELoss` (Sec. 3.3).
"""

from st_extensions.cross_encoder.head import VARIANTS, VariationalHead
from st_extensions.cross_encoder.model import VarCrossEncoder, build_var_cross_encoder, find_var_head

__all__ = ["VARIANTS", "VarCrossEncoder", "VariationalHead", "build_var_cross_encoder", "find_var_head"]
