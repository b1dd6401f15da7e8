"""This tree against other commits' in one run: a `step_bench.py --worker` process per tree on
the same GPU (benchmarks/side_by_side.py), one engine from each tree on the same weight format,
built and compiled at the same time, then given the same decode cases in turn, the trees
alternating case by case. A change's effect on a step then comes from one run on one machine,
not from two runs that a machine's drift or another card can separate; a third tree between the
two splits a pair of changes.

    git archive REV | (mkdir -p base_tree && tar -x -C base_tree)     # another tree
    python benchmarks/tree_ab_bench.py --base base_tree --out /tmp/ab.json --profile /tmp/ab
    python benchmarks/tree_ab_bench.py --base base_tree --base mid_tree --out /tmp/abc.json
    python benchmarks/tree_ab_bench.py --base . --dry-run               # the toy on the CPU, eager

Writes `{"trees": {"base": commit or path, "head": ...}, "results": [{"variant": "base"|"head",
"step", "requests", "tokens_each", "ms", "device_ms", "floor_ms", "kernels", ...}]}` (several
bases: labelled by their folders): each row is the worker's step_bench row (`graphs`:
step_bench's own variant, e.g. full). flash-slice native takes about 23 GB an engine, so two fit
an 80 GB card and three an H200.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import side_by_side  # noqa: E402

CASES = [("decode", 1, 1024), ("decode", 16, 1024), ("decode", 64, 1024)]
DRY_CASES = [("decode", 1, 64)]


def commit_of(tree: str) -> str:
    """The tree's git commit, or its path where it is not a checkout (a `git archive`)."""
    r = subprocess.run(["git", "-C", tree, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    inside = subprocess.run(["git", "-C", tree, "rev-parse", "--show-toplevel"], capture_output=True, text=True)
    same_root = inside.returncode == 0 and os.path.samefile(inside.stdout.strip(), tree)
    return r.stdout.strip() if r.returncode == 0 and same_root else os.path.abspath(tree)


def labelled(bases: list, head: str) -> dict:
    """{label: tree root}: one base is 'base'; several are named by their folders (base_tree,
    mid_tree, ...), in the order given; this tree is 'head', last."""
    roots = [os.path.abspath(b) for b in bases]
    names = ["base"] if len(roots) == 1 else [os.path.basename(r.rstrip(os.sep)) for r in roots]
    if len(set(names)) != len(names) or "head" in names:
        raise ValueError(f"--base folders need distinct names other than 'head': {names}")
    return {**dict(zip(names, roots)), "head": head}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", required=True, action="append",
                    help="another tree's root (a checkout or a git archive); repeated, one engine each")
    ap.add_argument("--weight-format", default="native", choices=["dequant", "native"])
    ap.add_argument("--model", default="flash-slice")
    ap.add_argument("--variant", default="full", help="step_bench's variant each worker runs")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--num-pages", type=int, default=1024,
                    help="KV pages of each engine (both share the GPU: neither may size its pool from memory)")
    ap.add_argument("--out", default=None, help="the JSON, rewritten after every case")
    ap.add_argument("--profile", default=None,
                    help="after the cases, each engine profiles a batch-1 decode step in turn into PROFILE.<tree>.txt")
    ap.add_argument("--dry-run", action="store_true", help="toy, CPU, eager, one small case; prints the JSON")
    a = ap.parse_args(argv)
    for base in a.base:
        if not os.path.isfile(os.path.join(base, "benchmarks", "step_bench.py")):
            ap.error(f"--base {base}: no benchmarks/step_bench.py there (the root of another tree)")
    trees = labelled(a.base, os.path.dirname(side_by_side.HERE))
    res = {"benchmark": "tree_ab", "model": "toy" if a.dry_run else a.model, "weight_format": a.weight_format,
           "date": datetime.date.today().isoformat(), "trees": {k: commit_of(t) for k, t in trees.items()},
           "method": "a step_bench worker per tree on one device, one engine each, the cases given to each in "
                     "turn (trees alternating case by case); CUDA events around LLMEngine.step, median after "
                     "warm-up; device_ms: the device busy time of one more step, overlapping kernels counted once"}
    side_by_side.run({k: side_by_side.worker(t, a.weight_format, a) for k, t in trees.items()},
                     DRY_CASES if a.dry_run else CASES, res, a.out, a.profile)
    if a.dry_run:
        print(json.dumps(res, default=str))
    return res


if __name__ == "__main__":
    main()
