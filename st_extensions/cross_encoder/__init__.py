"""VarCrossEncoder (``shared/papers/var-cross-encoder.md``): a CrossEncoder with a Gaussian latent and score.

:class:`VariationalHead` is the probabilistic module + linear ranker (Sec. 3.2), :class:`VarCrossEncoder` the
CrossEncoder that holds it (``predict(..., return_std=True)``), :func:`build_var_cross_encoder` builds one; the loss is
:class:`st_extensions.losses.VariationalBCELoss` (Sec. 3.3). :func:`load_cross_encoder` loads a saved cross-encoder
with its backbone on ONNX Runtime or OpenVINO (:mod:`~st_extensions.cross_encoder.backends`). Importing this package
registers its modules with :func:`st_extensions.loading.load_model`."""

from st_extensions.cross_encoder.backends import load_cross_encoder
from st_extensions.cross_encoder.head import VARIANTS, VariationalHead
from st_extensions.cross_encoder.model import (
    VarCrossEncoder,
    build_var_cross_encoder,
    find_var_head,
    predict_sharing_layers,
)
from st_extensions.cross_encoder.split import build_split_cross_encoder

__all__ = [
    "VARIANTS",
    "VarCrossEncoder",
    "VariationalHead",
    "build_split_cross_encoder",
    "build_var_cross_encoder",
    "find_var_head",
    "load_cross_encoder",
    "predict_sharing_layers",
]
