import os

# oneDNN picks AMX for some bf16 GEMM shapes on hosts that have it, and AVX-512 for others:
# two GEMMs over the same rows then round differently, and the bf16 bit-equality with the
# oracle (tests/test_bf16_parity.py) becomes a property of the host. Read at oneDNN's first
# primitive, so set before any test runs a GEMM.
os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_FP16")     # the last level below AMX

import pytest  # noqa: E402
import torch  # noqa: E402

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


@pytest.fixture
def g(request):
    """A CPU generator seeded per test (tests/kernel_cases.seeded_generator; V41_TEST_SEED pins the run)."""
    from tests.kernel_cases import seeded_generator
    return seeded_generator(request)
