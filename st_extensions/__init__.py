"""sentence-transformers extensions of pyterrier-prob: modules, losses and models.

Usable on its own with sentence-transformers; knows nothing of PyTerrier. The public names below are imported on
first use (:mod:`st_extensions.lazy`): importing a light submodule does not load sentence-transformers.
"""

from st_extensions.lazy import lazy_exports

__all__, __getattr__, __dir__ = lazy_exports(
    __name__,
    {  # module -> the names it gives to ``st_extensions``
        "st_extensions.cross_encoder": "VarCrossEncoder build_var_cross_encoder",
        "st_extensions.defaults": "default_model_path",
        "st_extensions.distributions": "BetaCosine ExpCosine",
        "st_extensions.loading": "load_model",
        "st_extensions.modules": "MixtureOfLogits MultiBranchQueryEncoder QueryDistributionHead",
        "st_extensions.mol": "build_mol_model encode_components find_mol",
        "st_extensions.partial": "LayerStateCache PartialTransformer partial_model",
        "st_extensions.pebr": "build_pebr_model encode_queries query_distribution",
        "st_extensions.unierf": "branch_text build_unierf_dataset build_unierf_model encode_branches find_branches "
        "unierf_columns",
    },
)
