"""The server under attack (issue 19), a companion of serve_bench.py: it starts
`python -m v41.serve` itself (toy model, CPU, a free loopback port), then runs at once

  * innocents: 64 streaming clients, each sending --requests-per-client requests;
  * an abort storm: --storm-clients clients that send many-choice requests and hang up
    (non-streaming ones time out, streaming ones leave after the first chunk), --storm-rounds each;
  * one attacker of each kind: a body over --max-request-body-bytes, JSON nested 100,000 deep,
    1,000 prompts x n=128, temperature 1e-50, a 12 MB prompt, an 8 MB stop string;

and checks that no innocent request failed (HTTP 200, every token, `[DONE]`, no error event),
each attacker got its own answer, and /metrics comes back to idle (nothing running or waiting,
every page and STATE slot free). Every loop is bounded; the run ends by itself.

    python benchmarks/serve_attack.py            # writes benchmarks/results/serve-attack-toy-cpu.json
"""
from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import platform
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from runtime.metrics import parse as parse_metrics  # noqa: E402

ATTACKS = {  # kind -> (request body as bytes or a dict, the status it must get, what its error code must be)
    "huge_body": (lambda: b" " * (17 << 20) + b"{}", 413, "request_too_large"),
    "deep_json": (lambda: b"[" * 100_000 + b"]" * 100_000, 400, None),
    "prompt_list_x_n": (lambda: {"prompt": ["attack"] * 1000, "n": 128, "max_tokens": 4}, 400, "too_many_choices"),
    "tiny_temperature": (lambda: {"prompt": "tiny", "temperature": 1e-50, "max_tokens": 8, "ignore_eos": True},
                         200, None),
    "huge_prompt": (lambda: {"prompt": "the window ring " * (12 << 16), "max_tokens": 4}, 400, "prompt_too_large"),
    "huge_stop": (lambda: {"prompt": "hi", "stop": "x" * (8 << 20), "max_tokens": 4}, 400, "stop_too_large"),
}


def start_server(args: list[str], timeout: float = 300.0) -> tuple[subprocess.Popen, str, str]:
    fd, log = tempfile.mkstemp(prefix="v41-attack-", suffix=".log")
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "v41.serve", "--port", "0", *args], cwd=ROOT, stdout=fd,
                            stderr=subprocess.STDOUT, env=env)
    os.close(fd)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        m = re.search(r"serving .* on (http://\S+) ", Path(log).read_text(errors="replace"))
        if m:
            return proc, m.group(1), log
        time.sleep(0.2)
    proc.kill()
    raise SystemExit(f"error: the server did not start:\n{Path(log).read_text(errors='replace')[-3000:]}")


async def innocent(c: httpx.AsyncClient, prompt: list[int], max_tokens: int) -> dict:
    """One streamed request; ok when it ends with every token, [DONE] and no error event."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    r = {"ok": False, "error": "", "gaps": []}
    t0 = last = time.perf_counter()
    try:
        async with c.stream("POST", "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                r["error"] = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return r
            done, tokens = False, None
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    r["error"] = chunk["error"]["message"]
                    return r
                now = time.perf_counter()
                r["gaps"].append(now - last)
                last = now
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
            r["ok"] = done and tokens == max_tokens
            r["error"] = "" if r["ok"] else f"done={done} tokens={tokens}"
    except Exception as e:  # noqa: BLE001 - a failure is a result
        r["error"] = f"{type(e).__name__}: {e}"
    r["latency"] = time.perf_counter() - t0
    return r


async def storm(base: str, rng: random.Random, rounds: int) -> dict:
    """Many-choice requests abandoned by their clients after 1 s: status counts (none of them is
    judged; 503 is the queue bound doing its work)."""
    seen: dict = {}
    for k in range(rounds):
        body = {"prompt": [[rng.randrange(5, 1000) for _ in range(8)] for _ in range(4)], "n": 8,
                "max_tokens": 64, "ignore_eos": True, "stream": k % 2 == 1}
        try:
            async with httpx.AsyncClient(base_url=base, timeout=1.0) as c:
                if body["stream"]:
                    async with c.stream("POST", "/v1/completions", json=body) as resp:
                        key = str(resp.status_code)
                        async for _ in resp.aiter_lines():
                            break                  # leaving hangs up mid-stream
                else:
                    key = str((await c.post("/v1/completions", json=body)).status_code)
        except httpx.TimeoutException:
            key = "hung up"
        seen[key] = seen.get(key, 0) + 1
    return seen


async def attack(c: httpx.AsyncClient, kind: str) -> dict:
    make, status, code = ATTACKS[kind]
    body = make()
    t0 = time.perf_counter()
    r = await (c.post("/v1/completions", content=body) if isinstance(body, bytes)
               else c.post("/v1/completions", json=body))
    got_code = r.json().get("error", {}).get("code") if r.status_code != 200 else None
    ok = r.status_code == status and got_code == code
    if status == 200:
        ok = ok and r.json()["usage"]["completion_tokens"] == body["max_tokens"]
    return {"kind": kind, "status": r.status_code, "expected": status, "code": got_code, "ok": ok,
            "seconds": round(time.perf_counter() - t0, 3)}


async def idle(c: httpx.AsyncClient, timeout: float) -> tuple[bool, float, dict]:
    t0 = time.monotonic()
    while True:
        ms = {k.split("{")[0]: v for k, v in parse_metrics((await c.get("/metrics")).text).items() if "{" in k
              and "_bucket" not in k}
        idle = (ms["v41:num_requests_running"] == 0 and ms["v41:num_requests_waiting"] == 0
                and ms["v41:num_free_pages"] == ms["v41:num_pages"] and ms["v41:num_free_slots"] == ms["v41:num_slots"])
        if idle or time.monotonic() - t0 > timeout:
            return idle, time.monotonic() - t0, ms
        await asyncio.sleep(0.2)


async def run(a, base: str) -> dict:
    rng = random.Random(a.seed)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=base, timeout=a.timeout, limits=limits) as c:
        version = (await c.get("/version")).json()

        async def client(i):
            out = []
            for _ in range(a.requests_per_client):
                out.append(await innocent(c, [rng.randrange(5, 1000) for _ in range(rng.randrange(4, 33))],
                                          a.max_tokens))
            return out
        t0 = time.perf_counter()
        jobs = [client(i) for i in range(a.clients)] + [storm(base, rng, a.storm_rounds) for _ in range(a.storm_clients)]
        jobs += [attack(c, kind) for kind in ATTACKS]
        res = await asyncio.gather(*jobs)
        duration = time.perf_counter() - t0
        innocents = [r for per in res[:a.clients] for r in per]
        storms = res[a.clients:a.clients + a.storm_clients]
        attacks = res[a.clients + a.storm_clients:]
        back, waited, ms = await idle(c, 60.0)
    gaps = sorted(g for r in innocents for g in r["gaps"][1:])
    storm_counts: dict = {}
    for s in storms:
        for k, v in s.items():
            storm_counts[k] = storm_counts.get(k, 0) + v
    failed = [r["error"] for r in innocents if not r["ok"]]
    return {
        "date": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "tool": "benchmarks/serve_attack.py", "device": "cpu",
        "host": {"platform": platform.platform(), "python": platform.python_version(), "cpu_count": os.cpu_count(),
                 "loadavg_at_end": list(os.getloadavg())},
        "versions": {"torch": version.get("torch"), "v41": version.get("version"), "httpx": httpx.__version__,
                     "git": subprocess.run(["git", "describe", "--always", "--dirty"], cwd=ROOT, capture_output=True,
                                           text=True).stdout.strip()},
        "server_args": a.server_args, "config": {k: v for k, v in vars(a).items() if k != "server_args"},
        "duration_s": round(duration, 2),
        "innocent": {"sent": len(innocents), "ok": len(innocents) - len(failed), "failed": len(failed),
                     "errors": sorted(set(failed))[:10],
                     "chunk_gap_ms": {"median": 1e3 * gaps[len(gaps) // 2] if gaps else None,
                                      "p99": 1e3 * gaps[int(0.99 * (len(gaps) - 1))] if gaps else None,
                                      "max": 1e3 * gaps[-1] if gaps else None}},
        "storm": {"requests": a.storm_clients * a.storm_rounds, "choices_each": 4 * 8, "outcomes": storm_counts},
        "attackers": attacks,
        "idle_after": {"idle": back, "waited_s": round(waited, 2),
                       "metrics": {k: ms[k] for k in ("v41:num_requests_running", "v41:num_requests_waiting",
                                                      "v41:num_free_pages", "v41:num_pages", "v41:num_free_slots",
                                                      "v41:num_slots", "v41:block_manager_check_failures_total")}},
        "passed": not failed and all(x["ok"] for x in attacks) and back
                  and ms["v41:block_manager_check_failures_total"] == 0,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="benchmarks/serve_attack.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--requests-per-client", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--storm-clients", type=int, default=4)
    ap.add_argument("--storm-rounds", type=int, default=6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=300.0, help="per innocent request and attacker (s)")
    ap.add_argument("--server-args", default="--model toy --max-model-len 128 --disable-access-log "
                                             "--uvicorn-log-level warning", help="flags of python -m v41.serve")
    ap.add_argument("--result", default=str(ROOT / "benchmarks" / "results" / "serve-attack-toy-cpu.json"))
    ap.add_argument("--no-save", dest="save", action="store_false")
    a = ap.parse_args(argv)
    proc, base, log = start_server(a.server_args.split())
    try:
        out = asyncio.run(run(a, base))
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        server_log = Path(log).read_text(errors="replace")
        os.unlink(log)
    out["server_tracebacks"] = server_log.count("Traceback")
    out["passed"] = out["passed"] and out["server_tracebacks"] == 0
    print(json.dumps({k: out[k] for k in ("duration_s", "innocent", "storm", "attackers", "idle_after", "passed")},
                     indent=1))
    if a.save:
        Path(a.result).write_text(json.dumps(out, indent=2) + "\n")
        print(f"wrote {a.result}", file=sys.stderr)
    return 0 if out["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
