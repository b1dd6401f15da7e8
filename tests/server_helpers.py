"""What the server tests share: a `python -m v41.serve` subprocess of the toy on a free loopback
port (float64, one torch thread) with its metrics, and isolated greedy references of the same
model in this process (`Reference`)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from runtime.metrics import parse as parse_metrics
from runtime.sequence import SamplingParams

ROOT = Path(__file__).resolve().parents[1]
KEY = "test-key-123"
MAX_MODEL_LEN = 128
MAX_NUM_SEQS = 64
SERVER_ARGS = ["--model", "toy", "--dtype", "float64", "--max-model-len", str(MAX_MODEL_LEN),
               "--max-num-seqs", str(MAX_NUM_SEQS), "--api-key", KEY, "--served-model-name", "toy",
               "v41-toy", "--disable-access-log", "--uvicorn-log-level", "warning"]
ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}


class Server:
    def __init__(self, proc, url, log_path):
        self.proc, self.url, self.log_path = proc, url, log_path
        self.http = httpx.Client(base_url=url, timeout=300, headers={"Authorization": f"Bearer {KEY}"})

    def log(self) -> str:
        return Path(self.log_path).read_text(errors="replace")

    def metrics(self) -> dict[str, float]:
        r = self.http.get("/metrics")
        assert r.status_code == 200, r.text
        return parse_metrics(r.text)

    def m(self, name: str, **labels) -> float:
        labels = {"model_name": "toy", **labels}        # prometheus_client writes labels sorted by name
        key = name + "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"
        return self.metrics()[key]

    def wait_idle(self, timeout=60.0) -> dict:
        """Until nothing runs or waits and every page and slot is back on its free list."""
        deadline = time.monotonic() + timeout
        while True:
            ms = self.metrics()
            g = lambda n: ms[f'{n}{{model_name="toy"}}']  # noqa: E731
            idle = (g("v41:num_requests_running") == 0 and g("v41:num_requests_waiting") == 0
                    and g("v41:num_free_pages") == g("v41:num_pages")
                    and g("v41:num_free_slots") == g("v41:num_slots"))
            if idle:
                assert g("v41:block_manager_check_failures_total") == 0
                return ms
            assert time.monotonic() < deadline, f"server not idle: {ms}"
            time.sleep(0.1)


def start_server(extra=(), timeout=240.0):
    fd, log_path = tempfile.mkstemp(prefix="v41-serve-", suffix=".log")
    env = dict(os.environ, **ONE_THREAD, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "v41.serve", "--port", "0", *SERVER_ARGS, *extra],
                            cwd=ROOT, stdout=fd, stderr=subprocess.STDOUT, env=env)
    os.close(fd)
    deadline = time.monotonic() + timeout
    url = None
    while url is None:
        text = Path(log_path).read_text(errors="replace")
        m = re.search(r"serving .* on (http://\S+) ", text)
        if m:
            url = m.group(1)
            break
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"server did not start (rc={proc.poll()}):\n{text}")
        time.sleep(0.2)
    while True:
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return Server(proc, url, log_path)
        except httpx.HTTPError:
            pass                # not listening yet: poll again until healthy, dead or past the deadline
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"server not healthy:\n{Path(log_path).read_text()}")
        time.sleep(0.2)


def stop_server(s) -> str:
    """Stop a server from start_server; returns its log."""
    s.http.close()
    s.proc.terminate()
    try:
        s.proc.wait(30)
    except subprocess.TimeoutExpired:
        s.proc.kill()
        s.proc.wait()
    log = s.log()
    os.unlink(s.log_path)
    return log


class Reference:
    """Isolated greedy runs of the same model in this process (cached)."""

    def __init__(self):
        import torch

        from v41.llm import LLM
        self.torch = torch
        n = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            self.llm = LLM("toy", dtype="float64", max_model_len=MAX_MODEL_LEN, max_num_seqs=4)
        finally:
            torch.set_num_threads(n)
        self.tok = self.llm.tokenizer
        self.cache: dict = {}

    def greedy(self, ids: list[int], max_tokens: int) -> list[int]:
        key = tuple(ids)
        hit = self.cache.get(key)
        if hit is None or (len(hit[1]) < max_tokens and hit[0] < max_tokens):
            n = self.torch.get_num_threads()
            self.torch.set_num_threads(1)
            try:
                out = self.llm.generate([list(ids)], SamplingParams(max_tokens=max_tokens, temperature=0.0))[0]
            finally:
                self.torch.set_num_threads(n)
            hit = self.cache[key] = (max_tokens, out.token_ids)
        return hit[1][:max_tokens]

    def chat_ids(self, messages) -> list[int]:
        return self.tok.encode(self.tok.apply_chat_template(messages))


def extra(c, name):
    v = getattr(c, name, None)
    if v is None and getattr(c, "model_extra", None):
        v = c.model_extra.get(name)
    return v
