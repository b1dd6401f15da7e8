"""Engines side by side on one device, the cases given to each in turn: `step_bench.py --worker`
processes (one engine each, built and compiled at the same time), for comparisons one run must
make with the variants alternating case by case (benchmarks/weight_formats_bench.py: bf16 and
native weights; benchmarks/tree_ab_bench.py: this tree against another commit's).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def worker(tree: str, weight_format: str, a, extra=()) -> dict:
    """Popen's arguments (command, environment, directory) of a step_bench worker of `tree` (a
    checkout's root) on `weight_format`, with the benchmark's model, variant, steps and KV pages
    (`a`)."""
    cmd = [sys.executable, os.path.join(tree, "benchmarks", "step_bench.py"), "--worker",
           "--weight-format", weight_format, "--model", a.model, "--variants", a.variant, "--steps", str(a.steps),
           "--no-agreement", "--num-pages", str(a.num_pages)] + (["--dry-run"] if a.dry_run else []) + list(extra)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [tree, os.environ.get("PYTHONPATH")]))}
    return dict(args=cmd, env=env, cwd=tree)


def reply(proc, prefix: str):
    """The JSON after `prefix` on the worker's next line that has it (other lines are its log)."""
    for line in proc.stdout:
        if line.startswith(prefix):
            return json.loads(line[len(prefix):])
    raise RuntimeError(f"step_bench worker exited (rc {proc.wait()}) before a {prefix.strip()} line")


def run(workers: dict, cases: list, res: dict, out: str | None, profile: str | None = None) -> dict:
    """Start `workers` ({label: `worker`'s Popen arguments}), wait for all to be ready
    (res["setup"], and each engine's weight bytes in res["weights_gb"]), give each case to each
    worker in turn (rows into res["results"] with the worker's label as "variant" and
    step_bench's own variant as "graphs"; `out` rewritten after every case), then with `profile`
    let each profile the first case's step in turn into PROFILE.<label>.txt. Any failure stops
    every worker."""
    procs = {label: subprocess.Popen(**w, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
             for label, w in workers.items()}
    try:
        res["setup"] = {label: reply(p, "READY ") for label, p in procs.items()}
        first = next(iter(res["setup"].values()))
        res.update({k: first.get(k) for k in ("device", "torch", "triton")})
        res["weights_gb"] = {label: next(iter(r["weights_gb"].values())) for label, r in res["setup"].items()}
        res.setdefault("results", [])
        for case in cases:
            for label, p in procs.items():
                p.stdin.write(json.dumps(case) + "\n")
                p.stdin.flush()
                for row in reply(p, "CASE "):
                    res["results"].append({**row, "graphs": row["variant"], "variant": label})
                    print(json.dumps(res["results"][-1]), flush=True)
            if out:
                with open(out, "w") as f:          # after every case: a run cut short keeps what it measured
                    json.dump(res, f, indent=1, default=str)
        for label, p in procs.items() if profile else ():    # one engine at a time: the others idle
            p.stdin.write(json.dumps({"profile": os.path.abspath(f"{profile}.{label}.txt"), "case": cases[0]}) + "\n")
            p.stdin.flush()
            reply(p, "CASE ")
    except BaseException:
        for p in procs.values():      # a worker that failed or a stop: the others go too
            p.kill()
        raise
    finally:
        for p in procs.values():
            p.stdin.close()
            p.wait()
    return res
