"""VarCrossEncoder (``shared/papers/var-cross-encoder.md``): a CrossEncoder with a Gaussian latent and score
(:class:`VariationalHead`, Sec. 3.2; loss: :class:`st_extensions.losses.VariationalBCELoss`, Sec. 3.3), and
:func:`load_cross_encoder` for a backbone on ONNX Runtime or OpenVINO. Importing it registers its modules with
:func:`st_extensions.loading.load_model`."""

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
