"""The compile flags (runtime/compile/config.py: CompileConfig from the engine settings, refused
settings) and the eager path (no compile: the runner's forward is the model)."""
import pytest

from runtime import compile as C
from runtime.engine import EngineArgs
from runtime.geometry import AdmissionError
from tests import harness as H


def test_flags(tmp_path):
    from v41 import generate
    from v41.serve import build_parser
    ap, names = build_parser()
    a = ap.parse_args(["--no-enforce-eager", "--level", "3", "--no-decoder-swa-bounded-replay",
                       "--dump-dir", str(tmp_path), "--compile-cache-dir", str(tmp_path), "--capture-sizes", "1,4"])
    args = EngineArgs(**{n: getattr(a, n) for n in names})
    assert (args.enforce_eager, args.compilation_level, args.decoder_swa_bounded_replay) == (False, 3, False)
    ccfg = C.CompileConfig.from_engine_args(args, args.max_num_batched_tokens)
    assert (ccfg.split, ccfg.dump_dir, ccfg.capture_sizes) == (False, str(tmp_path), (1, 4))
    assert ap.parse_args([]).enforce_eager is True and ap.parse_args(["--compilation-level", "0"]).compilation_level == 0
    with pytest.raises(SystemExit):
        ap.parse_args(["--level", "2"])
    assert C.CompileConfig.from_engine_args(EngineArgs(), 2048) is None                      # enforce_eager
    assert C.CompileConfig.from_engine_args(EngineArgs(enforce_eager=False, compilation_level=0), 2048) is None
    for bad in (dict(compilation_level=2), dict(capture_sizes="0,4"), dict(capture_sizes="4096")):
        with pytest.raises(AdmissionError):
            EngineArgs(model="toy", **bad).admit()
    with pytest.raises(SystemExit):
        generate.main(["--level", "1", "--prompt", "x"])


def test_eager_path_unchanged(toy_weights):
    eng = H.make_engine(toy_weights, "float32")
    assert eng.runner.forward is eng.runner.model and eng.compile_report is None
    assert not eng.runner.static_shapes
