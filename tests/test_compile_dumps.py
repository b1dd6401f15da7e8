"""Dumps (`--dump-dir`, runtime/compile/debug.py): the computation graph, the split, each pass's
graph before and after, match counts, Inductor's output code and depyf's dump."""
import json

import torch

from runtime import compile as C
from tests.compile_helpers import toy_prefix


def test_dumps_written(toy_weights, tmp_path):
    """--dump-dir: the computation graph, the split, each pass's graph before and after, match
    counts, Inductor's output code (Inductor compiles here, caches off), depyf's dump. On the toy
    cut to layer 0 (Inductor's C++ build of each piece is most of this test)."""
    from passes.manager import PassManager
    toy1 = toy_prefix(toy_weights, 1)
    runner = toy1.runner
    pm = PassManager(runner.cfg, runner.dtype, lowering="auto", only=("mhc", "backend_select"))
    fwd = C.CompiledForward(runner.model, runner.cache, C.CompileConfig(split=False, backend="inductor", passes=False,
                                                                       dump_dir=str(tmp_path)), pass_manager=pm)
    with torch.inference_mode(), C._depyf(str(tmp_path)):
        h = fwd(toy1.batch, runner.cache)
    torch.testing.assert_close(h, toy1.eager, rtol=1e-5, atol=1e-5)
    seg = tmp_path / "_Backbone"
    assert (seg / "computation_graph.py").exists() and (seg / "split_graph.py").exists()
    layer = next(p for p in seg.iterdir() if p.is_dir() and p.name.endswith("layers.0"))
    for f in ("post_grad.0.mhc.before.py", "post_grad.0.mhc.after.py", "post_grad.1.backend_select.before.py",
              "post_grad.1.backend_select.after.py", "output_code.py", "match_counts.json", "piece_graph.py"):
        assert (layer / f).exists(), f
    assert "v41.mhc_mix" in (layer / "post_grad.0.mhc.after.py").read_text()
    assert "v41.mhc_mix" not in (layer / "post_grad.0.mhc.before.py").read_text()
    assert json.loads((layer / "match_counts.json").read_text())["mhc"] == 6
    assert "def call(" in (layer / "output_code.py").read_text()
    try:
        import depyf  # noqa: F401
    except ImportError:
        return
    names = [p.name for p in (tmp_path / "depyf").iterdir()]
    assert any("transformed_code" in n or n.startswith("full_code") for n in names), names
