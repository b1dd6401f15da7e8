"""Serving benchmark against a running OpenAI-compatible server (like `vllm bench serve`).

    python -m v41.serve --port 8000 &
    python benchmarks/serve_bench.py --base-url http://127.0.0.1:8000 --num-prompts 64 \
        --input-len 32 --output-len 16 --max-concurrency 16

Prompts are random token ids (`--dataset random`: lengths uniform in input_len * [1 - r, 1 + r];
`--dataset fixed`: every prompt exactly input_len tokens); on /v1/chat/completions they are
random words. Requests arrive as a Poisson process at `--request-rate` (gamma intervals with
`--burstiness`; inf = all at once), at most `--max-concurrency` in flight, after
`--num-warmups` untimed requests. Every request streams; the benchmark reports TTFT, TPOT
(per request: (latency - TTFT) / (output tokens - 1)), ITL (gaps between streamed chunks) and
end-to-end latency (mean, median, std, p99), request and token throughput, and writes JSON to
`--result-dir` (default benchmarks/results/).
"""
from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import math
import os
import platform
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

WORDS = ("the window ring holds compressed keys and every page keeps owner rows while the indexer "
         "scores candidates for sparse attention over a flat ragged token batch with engram tables").split()


@dataclass
class Result:
    ok: bool = False
    prompt_len: int = 0
    output_len: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list = field(default_factory=list)
    error: str = ""
    start: float = 0.0


def make_prompts(a, vocab: int) -> list[tuple[object, int, int]]:
    """(prompt, approximate prompt length, max_tokens) per request."""
    rng = random.Random(a.seed)
    out = []
    for _ in range(a.num_prompts + a.num_warmups):
        if a.dataset == "fixed":
            n_in, n_out = a.input_len, a.output_len
        else:
            lo_i, hi_i = max(1, int(a.input_len * (1 - a.range_ratio))), max(1, int(a.input_len * (1 + a.range_ratio)))
            lo_o, hi_o = max(1, int(a.output_len * (1 - a.range_ratio))), max(1, int(a.output_len * (1 + a.range_ratio)))
            n_in, n_out = rng.randint(lo_i, hi_i), rng.randint(lo_o, hi_o)
        if a.endpoint.endswith("chat/completions"):
            prompt = " ".join(rng.choice(WORDS) for _ in range(n_in))
        else:
            prompt = [rng.randrange(a.min_token_id, vocab) for _ in range(n_in)]
        out.append((prompt, n_in, n_out))
    return out


def body(a, prompt, n_out) -> dict:
    b = {"model": a.model, "max_tokens": n_out, "temperature": a.temperature, "stream": True,
         "stream_options": {"include_usage": True}, "ignore_eos": a.ignore_eos}
    if a.endpoint.endswith("chat/completions"):
        b["messages"] = [{"role": "user", "content": prompt}]
    else:
        b["prompt"] = prompt
    return b


async def one(client: httpx.AsyncClient, a, prompt, n_in, n_out) -> Result:
    r = Result(prompt_len=n_in)
    t0 = r.start = time.perf_counter()
    last = None
    try:
        async with client.stream("POST", a.endpoint, json=body(a, prompt, n_out)) as resp:
            if resp.status_code != 200:
                r.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode()[:200]}"
                return r
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    r.error = chunk["error"].get("message", "error")
                    return r
                if chunk.get("usage"):
                    r.output_len = chunk["usage"]["completion_tokens"]
                    r.prompt_len = chunk["usage"]["prompt_tokens"]
                if not chunk.get("choices"):
                    continue
                c = chunk["choices"][0]
                content = c.get("text") if "text" in c else (c.get("delta") or {}).get("content")
                if not content and not c.get("finish_reason"):
                    continue
                now = time.perf_counter()
                if last is None:
                    r.ttft = now - t0
                else:
                    r.itl.append(now - last)
                last = now
        r.latency = time.perf_counter() - t0
        r.ok = r.output_len > 0
        if not r.ok:
            r.error = "no usage in the stream"
    except Exception as e:  # noqa: BLE001 - a failed request is a result
        r.error = f"{type(e).__name__}: {e}"
    return r


def intervals(a, n: int) -> list[float]:
    if a.request_rate == math.inf:
        return [0.0] * n
    rng = random.Random(a.seed + 1)
    theta = 1.0 / (a.request_rate * a.burstiness)
    return [rng.gammavariate(a.burstiness, theta) for _ in range(n)]


def stats(xs: list[float], pcts: list[float]) -> dict:
    if not xs:
        return {"mean": None, "median": None, "std": None, **{f"p{p:g}": None for p in pcts}}
    s = sorted(xs)

    def pct(p):
        k = (len(s) - 1) * p / 100
        lo, hi = math.floor(k), math.ceil(k)
        return s[lo] + (s[hi] - s[lo]) * (k - lo)
    return {"mean": statistics.fmean(s) * 1e3, "median": statistics.median(s) * 1e3,
            "std": (statistics.pstdev(s) if len(s) > 1 else 0.0) * 1e3,
            **{f"p{p:g}": pct(p) * 1e3 for p in pcts}}


async def run(a) -> dict:
    headers = {"Authorization": f"Bearer {a.api_key}"} if a.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=a.base_url, headers=headers, timeout=a.timeout, limits=limits) as client:
        models = (await client.get("/v1/models")).json()
        if "data" not in models:
            raise SystemExit(f"error: GET /v1/models: {models}")
        card = models["data"][0]
        a.model = a.model or card["id"]
        vocab = a.vocab_size or card.get("vocab_size")
        if vocab is None and not a.endpoint.endswith("chat/completions"):
            raise SystemExit("error: the server does not report vocab_size: pass --vocab-size")
        server = {}
        try:
            v = await client.get("/version")
            if v.status_code == 200:
                server = v.json()
        except httpx.HTTPError:
            pass
        reqs = make_prompts(a, vocab or 0)
        warm, timed = reqs[: a.num_warmups], reqs[a.num_warmups:]
        if warm:
            print(f"warm-up: {len(warm)} requests", file=sys.stderr)
            res = await asyncio.gather(*(one(client, a, *w) for w in warm))
            bad = [r.error for r in res if not r.ok]
            if bad:
                raise SystemExit(f"error: warm-up failed: {bad[0]}")
        sem = asyncio.Semaphore(a.max_concurrency) if a.max_concurrency else None

        async def limited(p):
            if sem is None:
                return await one(client, a, *p)
            async with sem:
                return await one(client, a, *p)

        print(f"benchmark: {len(timed)} requests, rate {a.request_rate}, max concurrency "
              f"{a.max_concurrency or 'unlimited'}", file=sys.stderr)
        t0 = time.perf_counter()
        tasks = []
        for p, gap in zip(timed, intervals(a, len(timed))):
            tasks.append(asyncio.create_task(limited(p)))
            if gap:
                await asyncio.sleep(gap)
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
        metrics_text = ""
        try:
            m = await client.get("/metrics")
            metrics_text = m.text if m.status_code == 200 else ""
        except httpx.HTTPError:
            pass

    ok = [r for r in results if r.ok]
    pcts = [float(p) for p in a.metric_percentiles.split(",")]
    tin = sum(r.prompt_len for r in ok)
    tout = sum(r.output_len for r in ok)
    tpots = [(r.latency - r.ttft) / (r.output_len - 1) for r in ok if r.output_len > 1]
    out = {
        "date": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "tool": "benchmarks/serve_bench.py",
        "device": a.device,
        "host": {"platform": platform.platform(), "python": platform.python_version(),
                 "cpu_count": os.cpu_count(), "loadavg_at_end": list(os.getloadavg())},
        "server": server,
        "config": {k: (v if not (isinstance(v, float) and math.isinf(v)) else "inf")
                   for k, v in vars(a).items() if k not in ("api_key",)},
        "completed": len(ok), "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:10],
        "duration_s": duration,
        "total_input_tokens": tin, "total_output_tokens": tout,
        "request_throughput": len(ok) / duration,
        "output_throughput": tout / duration,
        "total_token_throughput": (tin + tout) / duration,
        "ttft_ms": stats([r.ttft for r in ok], pcts),
        "tpot_ms": stats(tpots, pcts),
        "itl_ms": stats([x for r in ok for x in r.itl], pcts),
        "e2el_ms": stats([r.latency for r in ok], pcts),
    }
    if metrics_text:
        keep = ("v41:num_preemptions_total", "v41:request_success_total", "v41:engine_steps_total",
                "v41:block_manager_check_failures_total", "v41:num_free_pages", "v41:num_pages")
        out["server_metrics_at_end"] = {ln.rsplit(" ", 1)[0]: float(ln.rsplit(" ", 1)[1])
                                        for ln in metrics_text.splitlines()
                                        if ln and not ln.startswith("#") and ln.startswith(keep)}
    if a.save_detailed:
        out["requests"] = [asdict(r) for r in results]
    return out


def report(o: dict) -> str:
    lines = ["{s:{c}^60}".format(s=" Serving Benchmark Result ", c="=")]
    row = lambda k, v: lines.append(f"{k:<44}{v:>16}")  # noqa: E731
    row("Successful requests:", o["completed"])
    row("Failed requests:", o["failed"])
    row("Benchmark duration (s):", f"{o['duration_s']:.2f}")
    row("Total input tokens:", o["total_input_tokens"])
    row("Total generated tokens:", o["total_output_tokens"])
    row("Request throughput (req/s):", f"{o['request_throughput']:.2f}")
    row("Output token throughput (tok/s):", f"{o['output_throughput']:.2f}")
    row("Total token throughput (tok/s):", f"{o['total_token_throughput']:.2f}")
    for key, title in (("ttft_ms", "Time to First Token"), ("tpot_ms", "Time per Output Token (excl. 1st token)"),
                       ("itl_ms", "Inter-token Latency"), ("e2el_ms", "End-to-end Latency")):
        lines.append("{s:{c}^60}".format(s=f" {title} ", c="-"))
        for stat, v in o[key].items():
            if stat == "std":
                continue
            name = {"mean": "Mean", "median": "Median"}.get(stat, stat.upper())
            row(f"{name} {key.split('_')[0].upper()} (ms):", "n/a" if v is None else f"{v:.2f}")
    lines.append("=" * 60)
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="benchmarks/serve_bench.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-url", default=None, help="server URL (default: http://HOST:PORT)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--endpoint", default="/v1/completions", choices=["/v1/completions", "/v1/chat/completions"])
    ap.add_argument("--api-key", default=os.environ.get("V41_API_KEY"))
    ap.add_argument("--model", default=None, help="model name (default: the server's first)")
    ap.add_argument("--dataset", default="random", choices=["random", "fixed"])
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--range-ratio", type=float, default=0.5, help="random dataset: lengths in L*[1-r, 1+r]")
    ap.add_argument("--vocab-size", type=int, default=None, help="default: the server's model card")
    ap.add_argument("--min-token-id", type=int, default=5, help="random token ids start here (skip specials)")
    ap.add_argument("--request-rate", type=float, default=math.inf, help="requests/s (inf: all at once)")
    ap.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrivals (1 = Poisson)")
    ap.add_argument("--max-concurrency", type=int, default=None)
    ap.add_argument("--num-warmups", type=int, default=2)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                    help="generate exactly the requested output lengths (default: on)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=1800.0)
    ap.add_argument("--metric-percentiles", default="99", help="comma-separated percentiles besides mean and median")
    ap.add_argument("--device", default="unspecified", help="device label stored in the JSON, e.g. 'cpu (2 cores)'")
    ap.add_argument("--label", default="serve", help="prefix of the result file name")
    ap.add_argument("--result-dir", default=str(Path(__file__).resolve().parent / "results"))
    ap.add_argument("--result-filename", default=None)
    ap.add_argument("--no-save", dest="save", action="store_false")
    ap.add_argument("--save-detailed", action="store_true", help="keep every request's timings in the JSON")
    a = ap.parse_args(argv)
    a.base_url = a.base_url or f"http://{a.host}:{a.port}"
    if a.request_rate <= 0 or a.burstiness <= 0:
        ap.error("--request-rate and --burstiness must be positive")
    out = asyncio.run(run(a))
    print(report(out))
    if a.save:
        d = Path(a.result_dir)
        d.mkdir(parents=True, exist_ok=True)
        name = a.result_filename or (f"{a.label}-{a.dataset}-in{a.input_len}-out{a.output_len}-n{a.num_prompts}-"
                                     f"c{a.max_concurrency or 'inf'}-{dt.datetime.now():%Y%m%d-%H%M%S}.json")
        (d / name).write_text(json.dumps(out, indent=2) + "\n")
        print(f"wrote {d / name}", file=sys.stderr)
    return 0 if out["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
