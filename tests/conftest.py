import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def minilm_path() -> str:
    from st_extensions import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def base_model(minilm_path):
    from st_extensions import load_model

    return load_model(minilm_path, device="cpu")
