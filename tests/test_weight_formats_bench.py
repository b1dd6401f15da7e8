"""benchmarks/weight_formats_bench.py --dry-run: two step_bench workers (toy, CPU, eager), one per
weight format, given the same cases in turn; the rows alternate bf16 / native with their floors;
then each profiles a decode step."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def test_weight_formats_bench_dry_run(tmp_path):
    prof = tmp_path / "prof"
    r = subprocess.run([sys.executable, "benchmarks/weight_formats_bench.py", "--dry-run", "--profile", str(prof)],
                       cwd=REPO, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert set(res["weights_gb"]) == {"bf16", "native"} and res["weights_gb"]["native"] < res["weights_gb"]["bf16"]
    rows = res["results"]
    assert [(x["variant"], x["step"], x["requests"]) for x in rows] == [
        (v, s, n) for s, n in (("decode", 1), ("decode", 4), ("prefill", 2)) for v in ("bf16", "native")]
    assert all(x["ms"] > 0 and x["floor_ms"] > 0 and x["graphs"] == "eager" for x in rows)
    # the native engine reads fewer bytes a step than the dequantized one
    for bf, nat in zip(rows[::2], rows[1::2]):
        assert nat["bytes"] < bf["bytes"]
    # after the cases each engine profiled a batch-1 decode step (on the CPU: host tables only)
    for fmt in ("bf16", "native"):
        assert "==== eager decode, 1 request(s)" in (tmp_path / f"prof.{fmt}.txt").read_text()


def test_tree_ab_bench_dry_run(tmp_path):
    """benchmarks/tree_ab_bench.py --dry-run against a `git archive` of this checkout: one worker
    from each tree, the case's rows base then head, the trees named (the archive by its path);
    a --base that is no tree is refused by name."""
    base = tmp_path / "base"
    base.mkdir()
    archive = subprocess.run(["git", "archive", "HEAD"], cwd=REPO, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(base)], input=archive, check=True)
    r = subprocess.run([sys.executable, "benchmarks/tree_ab_bench.py", "--dry-run", "--base", str(base)],
                       cwd=REPO, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["trees"]["base"] == str(base) and res["trees"]["head"]
    assert [(x["variant"], x["step"], x["requests"]) for x in res["results"]] == [
        ("base", "decode", 1), ("head", "decode", 1)]
    assert all(x["ms"] > 0 and x["graphs"] == "eager" for x in res["results"])
    bad = subprocess.run([sys.executable, "benchmarks/tree_ab_bench.py", "--dry-run", "--base", str(tmp_path)],
                         cwd=REPO, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "no benchmarks/step_bench.py" in bad.stderr


def test_tree_ab_labels_its_trees():
    """One base is 'base'; several are named by their folders, in order, this tree last."""
    from benchmarks.tree_ab_bench import labelled
    assert list(labelled(["/x/base_tree"], "/h")) == ["base", "head"]
    assert labelled(["/x/base_tree", "/x/mid_tree/"], "/h") == {"base_tree": "/x/base_tree", "mid_tree": "/x/mid_tree",
                                                                "head": "/h"}
    with pytest.raises(ValueError, match="distinct names"):
        labelled(["/x/t", "/y/t"], "/h")
