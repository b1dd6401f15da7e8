"""OpenAI-compatible server:

    python -m v41.serve                                   # the toy model on 127.0.0.1:8000
    python -m v41.serve --model /path/to/ckpt --port 8080 --api-key secret --max-num-seqs 64

Every engine flag comes from `EngineArgs.add_cli_args` (one `--flag` per field, `--[no-]flag` for
switches; the same flags in v41.generate and v41.prebuild). Settings are checked
(`EngineArgs.from_cli_args`, `EngineArgs.admit()`) and the port is bound before any weight is
read: a refusal prints `error: ...` and exits with status 2 (`runtime.cli.exit_on_refusal`).
"""
from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
import time

from runtime.cli import exit_on_refusal
from runtime.engine_args import EngineArgs
from runtime.geometry import AdmissionError

log = logging.getLogger("v41.serve")


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
    s.add_argument("--max-choices-per-request", type=int, default=256,
                   help="largest number of prompts x n in one request (default 256)")
    s.add_argument("--max-request-body-bytes", type=int, default=16 << 20,
                   help="larger request bodies get 413 (default 16 MiB)")
    s.add_argument("--max-queued-requests", type=int, default=1024,
                   help="choices waiting to be scheduled, over all requests; a request that would pass "
                        "it gets 503 with Retry-After (default 1024)")
    s.add_argument("--max-prompt-bytes", type=int, default=0,
                   help="larger prompt texts (a chat's messages together) get 400 before they are tokenized "
                        "(default 0: max-model-len x the longest token's bytes, the most text that fits)")
    s.add_argument("--max-stop-bytes", type=int, default=4096,
                   help="most bytes of a request's stop strings together (default 4096)")
    s.add_argument("--health-stall-timeout", type=float, default=30.0,
                   help="/health answers 503 once the engine has not stepped for this many seconds "
                        "while requests are queued (default 30)")
    s.add_argument("--no-warmup", dest="warmup", action="store_false",
                   help="skip the one-request warm-up before the port opens")
    s.add_argument("--allow-benchmark-only", action="store_true",
                   help="serve with benchmark-only engine settings (--spec-decode-acceptance-length: tokens that are "
                        "not the model's); refused without this flag")
    names = EngineArgs.add_cli_args(ap)
    return ap, names


def check_server_args(a) -> None:
    if not 0 <= a.port <= 65535:
        raise AdmissionError(f"port: {a.port} is not in [0, 65535]")
    if a.max_logprobs < 0:
        raise AdmissionError(f"max_logprobs: {a.max_logprobs} must be >= 0")
    for name in ("max_prompt_bytes", "max_stop_bytes"):
        if getattr(a, name) < 0:
            raise AdmissionError(f"{name}: {getattr(a, name)} must be >= 0")
    if a.max_choices_per_request < 1:
        raise AdmissionError(f"max_choices_per_request: {a.max_choices_per_request} must be >= 1")
    if a.max_queued_requests < a.max_choices_per_request:
        raise AdmissionError(f"max_queued_requests: {a.max_queued_requests} is below max_choices_per_request "
                             f"{a.max_choices_per_request}: a request of that many choices could never be queued")
    length = getattr(a, "spec_decode_acceptance_length", None)
    if length is not None and not a.allow_benchmark_only:
        raise AdmissionError(f"spec_decode_acceptance_length={length} (--spec-decode-acceptance-length) is a "
                             f"benchmark-only switch (verify steps accept drafts whatever the model says): the "
                             f"server refuses it unless --allow-benchmark-only is given")
    if a.api_key is not None and not a.api_key.strip():
        raise AdmissionError("api_key: empty")
    dev = getattr(a, "device", None)
    if dev and dev.startswith("cuda"):
        import torch
        if not torch.cuda.is_available():
            raise AdmissionError(f"device: {dev!r} but torch sees no CUDA device")


def bind(host: str, port: int) -> socket.socket:
    try:
        return _bind(host, port)
    except OSError as e:
        raise AdmissionError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None


def _bind(host: str, port: int) -> socket.socket:
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
    ap, _ = build_parser()
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    names_served = a.served_model_name or [a.model]
    with exit_on_refusal() as refused:
        eargs = EngineArgs.from_cli_args(a)
        check_server_args(a)
        eargs.admit()                                   # before any weight is read
        sock = bind(a.host, a.port)
        import uvicorn

        from runtime.engine import LLMEngine
        from runtime.metrics import ServingMetrics
        from runtime.server import AsyncEngine, create_app
        engine = LLMEngine(eargs)
    if refused:
        return refused.status
    host, port = sock.getsockname()[:2]
    if a.warmup:
        warmup(engine)
    metrics = ServingMetrics(names_served[0])
    aeng = AsyncEngine(engine, metrics)
    app = create_app(aeng, names_served, api_key=a.api_key, max_logprobs=a.max_logprobs, model_path=a.model,
                     stall_timeout=a.health_stall_timeout, max_choices=a.max_choices_per_request,
                     max_body_bytes=a.max_request_body_bytes, max_queued=a.max_queued_requests,
                     max_prompt_bytes=a.max_prompt_bytes or None, max_stop_bytes=a.max_stop_bytes)
    shown = f"[{host}]" if ":" in host else host
    print(f"v41 serving {names_served[0]!r} on http://{shown}:{port} (max_model_len {engine.max_model_len}, "
          f"{'API key required' if a.api_key else 'no API key'})", flush=True)
    config = uvicorn.Config(app, log_level=a.uvicorn_log_level, access_log=not a.disable_access_log,
                            timeout_graceful_shutdown=5, timeout_keep_alive=30)
    uvicorn.Server(config).run(sockets=[sock])
    return 0


if __name__ == "__main__":
    sys.exit(main())
