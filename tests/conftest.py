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


# `make test`'s wall time is its busiest worker's. pytest-xdist (--dist loadfile, with
# --no-loadscope-reorder) hands out files in collection order, so the longest go first and the
# short ones fill in at the end (its default order, most tests first, puts the interpreter's
# files, two long tests each, among the last). The longest files by cpu-suite-20261205.json's
# file seconds:
LONGEST_FIRST = ("test_dspark_compiled.py", "test_compiled_invariance.py", "test_native_experts.py",
                 "test_kernels_cpu.py", "test_token_graphs.py", "test_dspark_engine.py", "test_tensor_parallel.py",
                 "test_server.py", "test_compile_segments.py", "test_schedule_invariance.py", "test_native_gemm.py",
                 "test_prefix_cache.py")


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONGEST_FIRST)))      # stable: files keep their order


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


# ---- the toy server (tests/test_server*.py) ------------------------------------------------

@pytest.fixture(scope="session")
def server():
    """A `python -m v41.serve` subprocess of the toy (tests/server_helpers.py), one per worker;
    its log must hold no traceback when it stops."""
    from tests.server_helpers import start_server, stop_server
    s = start_server()
    yield s
    log = stop_server(s)
    assert "Traceback" not in log, log[-4000:]


@pytest.fixture(scope="session")
def client(server):
    import openai

    from tests.server_helpers import KEY
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, timeout=300, max_retries=0)


@pytest.fixture(scope="session")
def ref():
    """Isolated greedy runs of the server's model in this process."""
    from tests.server_helpers import Reference
    return Reference()
