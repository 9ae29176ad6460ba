"""pyterrier-prob: probabilistic and learned-similarity retrieval for PyTerrier.

PyTerrier transformers, indexes, evaluation and the ``pyterrier-prob`` command; the models, modules and
losses they use live in :mod:`st_extensions`.
"""

__version__ = "0.1.0"
