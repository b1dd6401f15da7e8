"""benchmarks/results/ holds what the README and docs cite, and nothing else: a cited result file
that is missing fails, and so does a file no page cites (superseded results leave the folder;
git keeps their history)."""
import fnmatch
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
# names in the pages that are not result files: inputs, and outputs of example commands
NOT_RESULTS = {"config.json", "tokenizer.json", "piece-bisect.json", "compile-quant-configs.json"}
NAME = re.compile(r"[\w.*-]+\.(?:json|txt|png)\b")


def cited() -> dict[str, str]:
    """Cited name or glob -> the page that cites it."""
    out = {}
    for page in PAGES:
        for name in NAME.findall(page.read_text()):
            name = name.rsplit("/", 1)[-1]
            if name not in NOT_RESULTS:
                out.setdefault(name, page.name)
    return out


def test_every_cited_result_exists():
    files = [f.name for f in RESULTS.iterdir()]
    missing = {n: page for n, page in cited().items() if not fnmatch.filter(files, n)}
    assert not missing, f"cited but not in benchmarks/results/: {missing}"


def test_every_result_is_cited():
    names = cited()
    stray = [f.name for f in sorted(RESULTS.iterdir()) if not any(fnmatch.fnmatch(f.name, n) for n in names)]
    assert not stray, f"in benchmarks/results/ but cited by no page (README.md, docs/): {stray}"
