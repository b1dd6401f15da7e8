"""OpenAI-compatible server:

    python -m v41.serve                                   # the toy model on 127.0.0.1:8000
    python -m v41.serve --model /path/to/ckpt --port 8080 --api-key secret --max-num-seqs 64

Every engine flag comes from `EngineArgs` (one `--flag` per field, `--[no-]flag` for switches).
Settings are checked (`EngineArgs.admit()`) and the port is bound before any weight is read: a
refusal prints `error: ...` and exits with status 2.
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import socket
import sys
import time
import types
import typing

from runtime.engine import EngineArgs
from runtime.geometry import AdmissionError
from v41.config import ConfigError

log = logging.getLogger("v41.serve")

HELP = {
    "model": "preset name (toy, flash-slice, flash) or a directory with config.json, tokenizer and "
             "safetensors",
    "dtype": "activation/weight compute dtype: bfloat16, float32 or float64",
    "device": "cpu or cuda (default: cuda when available)",
    "load_format": "auto, safetensors or dummy (random weights of a preset)",
    "seed": "seed of a preset's random weights",
    "tensor_parallel_size": "tensor-parallel ranks",
    "pipeline_parallel_size": "pipeline-parallel ranks (refused: V4.1 serving has no PP)",
    "context_parallel_size": "context-parallel ranks (refused: V4.1 serving has no CP)",
    "kv_cache_dtype": "main KV pool: bf16 or fp4",
    "index_cache_dtype": "indexer key plane: fp8 (default) or fp4",
    "block_size": "PAGE tokens (hash block); default: the model's",
    "max_num_seqs": "most requests in the running batch (= STATE slots)",
    "max_num_batched_tokens": "most tokens computed in one engine step",
    "max_prefill_chunk": "most prompt tokens of one request per step (default: the step budget)",
    "max_model_len": "longest prompt + completion (default: min(max_position_embeddings, 8192))",
    "num_pages": "cache pages (default: every running request at max_model_len)",
    "enforce_eager": "run the eager model (no torch.compile / CUDA graphs)",
    "compilation_level": "0: no torch.compile; 3: compiled segments (needs --no-enforce-eager)",
    "decoder_swa_bounded_replay": "compile the forward as _EarlyLayers/_LateLayers around the "
                                  "boundary layer (off: one _Backbone graph)",
    "compile_cache_dir": "root of the keyed compile caches (default: ~/.cache/v41/compile; "
                         "python -m v41.prebuild fills it)",
    "capture_sizes": "token counts warmed up after compiling, e.g. 1,2,4,8,512 (default: 1,2,4,8 "
                     "and max-num-batched-tokens)",
    "dump_dir": "write graphs, each pass's graph before/after, match counts, Inductor output code "
                "and depyf's decompiled bytecode here",
    "speculative_method": "speculative decoding method (dspark)",
}

# Seed flags that name features not built here: refused with a clear message when given.
NOT_BUILT = {
    "--enable-dp-attention": "DP attention",
    "--enable-tbo": "two-batch overlap",
    "--cudagraph-mode": "CUDA-graph modes",
    "--num-speculative-tokens": "speculative decoding",
    "--attn-prefill-chunk-size": "a separate attention prefill chunk",
}


def _base_type(t):
    if isinstance(t, types.UnionType) or typing.get_origin(t) is typing.Union:
        args = [a for a in typing.get_args(t) if a is not type(None)]
        return args[0] if len(args) == 1 else str
    return t


def add_engine_flags(ap: argparse.ArgumentParser) -> list[str]:
    """One flag per EngineArgs field; returns the field names."""
    g = ap.add_argument_group("engine")
    hints = typing.get_type_hints(EngineArgs)
    names = []
    for f in dataclasses.fields(EngineArgs):
        t = _base_type(hints.get(f.name, str))
        if t not in (bool, int, float, str):
            continue
        default = f.default if f.default is not dataclasses.MISSING else None
        flag = "--" + f.name.replace("_", "-")
        flags = [flag] + {"speculative_method": ["--method"], "compilation_level": ["--level"]}.get(f.name, [])
        choices = {"compilation_level": (0, 3)}.get(f.name)
        h = HELP.get(f.name, f.name.replace("_", " "))
        if t is bool:
            g.add_argument(*flags, dest=f.name, action=argparse.BooleanOptionalAction, default=default,
                           help=f"{h} (default: {'on' if default else 'off'})")
        else:
            g.add_argument(*flags, dest=f.name, type=t, default=default, choices=choices,
                           metavar=f.name.upper() if choices is None else None,
                           help=f"{h} (default: {default})" if default is not None else h)
        names.append(f.name)
    have = {a for act in ap._actions for a in act.option_strings}
    for flag, what in NOT_BUILT.items():
        if flag not in have:
            g.add_argument(flag, dest="_nb_" + flag[2:].replace("-", "_"), nargs="?", const=True,
                           default=None, help=argparse.SUPPRESS)
    return names


def build_parser() -> tuple[argparse.ArgumentParser, list[str]]:
    ap = argparse.ArgumentParser(prog="python -m v41.serve",
                                 description="OpenAI-compatible server for DeepSeek-V4.1 models")
    s = ap.add_argument_group("server")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, loopback only)")
    s.add_argument("--port", type=int, default=8000, help="port (0: any free port; default: 8000)")
    s.add_argument("--api-key", default=os.environ.get("V41_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on every route but /health "
                        "(default: $V41_API_KEY, else no key)")
    s.add_argument("--served-model-name", nargs="+", default=None,
                   help="model name(s) clients use; the first is reported (default: --model)")
    s.add_argument("--max-logprobs", type=int, default=20, help="largest logprobs / top_logprobs (default 20)")
    s.add_argument("--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"])
    s.add_argument("--disable-access-log", action="store_true", help="no per-request access log lines")
    s.add_argument("--no-warmup", dest="warmup", action="store_false",
                   help="skip the one-request warm-up before the port opens")
    names = add_engine_flags(ap)
    return ap, names


def check_server_args(a) -> None:
    if not 0 <= a.port <= 65535:
        raise AdmissionError(f"port: {a.port} is not in [0, 65535]")
    if a.max_logprobs < 0:
        raise AdmissionError(f"max_logprobs: {a.max_logprobs} must be >= 0")
    if a.api_key is not None and not a.api_key.strip():
        raise AdmissionError("api_key: empty")
    dev = getattr(a, "device", None)
    if dev and dev.startswith("cuda"):
        import torch
        if not torch.cuda.is_available():
            raise AdmissionError(f"device: {dev!r} but torch sees no CUDA device")
    for k, v in vars(a).items():
        if k.startswith("_nb_") and v is not None:
            flag = "--" + k[4:].replace("_", "-")
            raise AdmissionError(f"{flag}: {NOT_BUILT[flag]} is not built in v41 yet")


def bind(host: str, port: int) -> socket.socket:
    info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, stype, proto, _, addr = info[0]
    sock = socket.socket(family, stype, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if family == socket.AF_INET6:
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    sock.bind(addr)
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def warmup(engine) -> None:
    """One short request through every stage, so the first client does not pay first-call costs."""
    from runtime.sequence import SamplingParams
    t0 = time.perf_counter()
    tok = 5 % engine.cfg.vocab_size
    engine.add_request([tok] * 4, SamplingParams(max_tokens=2, ignore_eos=True), "v41-warmup")
    while engine.has_unfinished():
        engine.step()
    if not engine.bm.all_free:
        raise RuntimeError("warm-up left pages or slots held")
    log.info("warm-up done in %.1fs", time.perf_counter() - t0)


def main(argv=None) -> int:
    ap, names = build_parser()
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    eargs = EngineArgs(**{n: getattr(a, n) for n in names})
    try:
        check_server_args(a)
        eargs.admit()                                   # before any weight is read
        sock = bind(a.host, a.port)
    except (AdmissionError, ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"error: cannot listen on {a.host}:{a.port}: {e.strerror or e}", file=sys.stderr)
        return 2
    host, port = sock.getsockname()[:2]

    import uvicorn

    from runtime.engine import LLMEngine
    from runtime.metrics import ServingMetrics
    from runtime.server import AsyncEngine, create_app
    names_served = a.served_model_name or [a.model]
    try:
        engine = LLMEngine(eargs)
    except (AdmissionError, ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if a.warmup:
        warmup(engine)
    metrics = ServingMetrics(names_served[0])
    aeng = AsyncEngine(engine, metrics)
    app = create_app(aeng, names_served, api_key=a.api_key, max_logprobs=a.max_logprobs, model_path=a.model)
    shown = f"[{host}]" if ":" in host else host
    print(f"v41 serving {names_served[0]!r} on http://{shown}:{port} (max_model_len {engine.max_model_len}, "
          f"{'API key required' if a.api_key else 'no API key'})", flush=True)
    config = uvicorn.Config(app, log_level=a.uvicorn_log_level, access_log=not a.disable_access_log,
                            timeout_graceful_shutdown=5, timeout_keep_alive=30)
    uvicorn.Server(config).run(sockets=[sock])
    return 0


if __name__ == "__main__":
    sys.exit(main())
