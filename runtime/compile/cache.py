"""Compile keys and the keyed cache directory: everything a compiled graph depends on (config,
graph-shaping engine settings, compile settings, split points, capture sizes, source hashes,
versions, device arch) hashed into `<root>/<key>/`, which holds Inductor's and Triton's caches,
built under the key's lock and marked READY (v41/keyed_dir.py)."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import platform
from pathlib import Path

import torch

from runtime.compile.config import CompileConfig
from runtime.compile.segments import SplitPoints
from v41.keyed_dir import KeyedDir, hash_files

log = logging.getLogger("v41.compile")

REPO = Path(__file__).resolve().parents[2]
# the source files whose code is traced or shapes the compiled graphs (hashed into the key): the
# model and every v41 module it imports (v41/config.py is keyed by its values, the config; the
# topology derived from them is code: hashed), the runner (the Batch), and this package
# (tests/test_compile_cache.py checks the model's imports)
TRACED_SOURCES = ("v41/model.py", "v41/attention.py", "v41/moe.py", "v41/moe_route.py", "v41/mhc.py",
                  "v41/layers.py", "v41/quant.py", "v41/engram/device.py", "v41/topology.py", "v41/parallel.py",
                  "v41/dspark.py", "runtime/model_runner.py",
                  *(f"runtime/compile/{m}.py" for m in ("__init__", "backend", "cache", "config", "debug",
                                                        "draft", "forward", "piece_graphs", "segments")))
# EngineArgs fields that cannot change a compiled graph (every other field is in the key: opt-out,
# so a new engine setting is keyed until someone decides otherwise). The model is keyed by its
# config, the device by its arch, the compile settings by CompileConfig.
NOT_KEYED = {"model", "device", "seed", "load_format", "max_prefill_chunk",
             "enforce_eager", "compilation_level", "decoder_swa_bounded_replay", "compile_cache_dir",
             "capture_sizes", "dump_dir", "extra", "cudagraph_mode", "cudagraph_capture_sizes",
             "gpu_memory_utilization", "spec_decode_acceptance_length"}


def _file_hash(paths) -> str:
    return hash_files(paths, root=REPO).hexdigest()


def source_hashes() -> dict:
    """Content hashes of what the compiled graphs are made from: traced model code, pass files,
    op files (schemas, fake and reference impls, kernels)."""
    return {
        "model": _file_hash(REPO / f for f in TRACED_SOURCES),
        "passes": _file_hash((REPO / "passes").glob("*.py")),
        "ops": _file_hash((REPO / "custom_ops").rglob("*.py")),
    }


def _version(mod: str) -> str | None:
    try:
        m = __import__(mod)
        return getattr(m, "__version__", "unknown")
    except Exception:  # noqa: BLE001  (absent or broken: not part of this build)
        return None


def device_arch(device) -> str:
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(device)
        arch = getattr(props, "gcnArchName", None) or "sm_%d%d" % (props.major, props.minor)
        return f"cuda:{arch}"
    return f"{device.type}:{platform.machine()}"


def key_factors(cfg, args, ccfg: CompileConfig, device) -> dict:
    """Everything a compiled graph depends on, as plain JSON values. Changing any one of them
    gives a new cache directory (tests/test_compile_cache.py checks each)."""
    points = SplitPoints.of(cfg)
    return {
        "config": cfg.to_hf_dict(),
        "runtime": {f.name: getattr(args, f.name) for f in dataclasses.fields(args)
                    if f.name not in NOT_KEYED},
        "compile": {"level": ccfg.level, "backend": str(ccfg.backend), "passes": ccfg.passes,
                    "fused_lowering": ccfg.fused_lowering,
                    **({"splitting_ops": list(ccfg.splitting_ops)} if ccfg.splitting_ops else {})},
        "split": ({"segments": ["_EarlyLayers", "_LateLayers"] + [f"_Layer{i}" for i in points.single]
                   + ([] if ccfg.splitting_ops else [points.query_segment]),
                   "early": [0, points.boundary],
                   "late": [points.boundary + 1, points.last], "single": list(points.single)}
                  if ccfg.split else {"segments": ["_Backbone"]}),
        "capture_sizes": list(ccfg.capture_sizes),
        "sources": source_hashes(),
        "versions": {"torch": torch.__version__, "triton": _version("triton"), "aiter": _version("aiter"),
                     "python": platform.python_version()},
        "device": device_arch(device),
    }


def compile_key(factors: dict) -> str:
    return hashlib.sha256(json.dumps(factors, sort_keys=True, default=str).encode()).hexdigest()[:16]


class CacheDir(KeyedDir):
    """`<root>/<key>/` (v41/keyed_dir.py: the lock, the READY marker), filled in place: Inductor's
    and Triton's caches inside, and the key's factors in factors.json."""

    def __init__(self, root, factors: dict):
        self.factors = factors
        super().__init__(root, compile_key(factors), marker="READY")

    def activate(self) -> None:
        """Point Inductor's and Triton's caches into this directory (before any compile)."""
        self.path.mkdir(parents=True, exist_ok=True)
        (self.path / "factors.json").write_text(json.dumps(self.factors, indent=1, sort_keys=True, default=str))
        ind = str(self.path / "inductor")
        if os.environ.get("TORCHINDUCTOR_CACHE_DIR") != ind:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = ind
            os.environ["TRITON_CACHE_DIR"] = str(self.path / "triton")
            try:      # in-memory caches keyed by the old directory
                from torch._inductor.utils import clear_caches
                clear_caches()
            except Exception as e:  # noqa: BLE001  (absent in some torch versions: nothing to clear)
                log.debug("inductor clear_caches unavailable: %s", e)
