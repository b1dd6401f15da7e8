import os

import pytest
import torch

os.environ.setdefault("V41_CACHE", os.path.join(os.path.dirname(__file__), "..", ".cache", "v41"))
torch.set_num_threads(1)  # tiny ops: one thread is fastest and keeps reductions fixed


@pytest.fixture(scope="session")
def toy_cfg():
    from v41.config import preset
    return preset("toy")


@pytest.fixture(scope="session")
def toy_weights(toy_cfg):
    """The toy's random-weight checkpoint, built once per test session (the same tensors the
    checkpoint writer puts on disk; tests/test_loader.py checks that equality)."""
    from v41.loader import dummy_weights
    return dummy_weights(toy_cfg, progress=False)


@pytest.fixture(scope="session")
def toy_token_map(toy_cfg):
    from v41.tokenizer import load_tokenizer
    return load_tokenizer("toy", toy_cfg)[1]
