"""Engine settings: `EngineArgs` (a dataclass whose fields are also the CLI flags) and its
admission (`EngineArgs.admit`: every refusal before a weight is read)."""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field, fields

import torch

from runtime.geometry import INDEX_CACHE_DTYPES, KV_CACHE_DTYPES, AdmissionError, PoolGeometry
from v41.config import V41Config, load_config, validate_page
from v41.parallel import check_divisible

DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32,
          "fp32": torch.float32, "float64": torch.float64}
# A block id names this many index rows, and an owner of compress ratio r keeps PAGE/r rows of a
# PAGE: so PAGE >= 16 * the largest owner ratio (32 tokens with the ratio-2 owners of V4.1).
INDEX_ROWS_PER_BLOCK_ID = 16

CUDAGRAPH_MODES = ("NONE", "FULL", "TR_HYBRID")

# Seed flags whose features are not built: every CLI takes them (so they are not "unrecognized
# arguments") and refuses them by name before a weight is read. Not EngineArgs fields: a field
# would enter the compile cache key (runtime/compile/cache.py keys every field it does not list).
NOT_BUILT = {
    "--enable-expert-parallel": "expert parallelism",
    "--kv-transfer-config": "KV transfer (disaggregated prefill/decode)",
    "--enable-dp-attention": "DP attention",
    "--enable-tbo": "two-batch overlap",
    "--attn-prefill-chunk-size": "a separate attention prefill chunk",
}


def _opt(default, help: str, **cli):
    """A field with its CLI help (and `aliases`: more option strings) in one place."""
    if isinstance(default, dict):
        return field(default_factory=dict, metadata={"help": help, **cli})
    return field(default=default, metadata={"help": help, **cli})


def _not_built(flag: str, value, what: str) -> AdmissionError:
    name = flag[2:].replace("-", "_")
    return AdmissionError(f"{name}={value!r} ({flag}): {what} is not built in v41 yet")


def _nb_dest(flag: str) -> str:
    return "_not_built_" + flag[2:].replace("-", "_")


class _EagerAction(argparse.BooleanOptionalAction):
    """--[no-]enforce-eager; keeps the namespace's compilation_level in step."""

    def __call__(self, parser, ns, values, option_string=None):
        super().__call__(parser, ns, values, option_string)
        ns.compilation_level = 0 if ns.enforce_eager else 3


class _LevelAction(argparse.Action):
    """-O/--compilation-level/--level {0,3}: sets the one switch, enforce_eager."""

    def __call__(self, parser, ns, values, option_string=None):
        ns.compilation_level, ns.enforce_eager = values, values == 0


@dataclass
class _EngineFields:
    model: str = _opt("toy", "preset name (toy, flash-slice, flash) or a directory with config.json, "
                             "tokenizer and safetensors")
    dtype: str = _opt("bfloat16", f"activation/weight compute dtype: {', '.join(DTYPES)}")
    device: str | None = _opt(None, "cpu or cuda (default: cuda when available)")
    load_format: str = _opt("auto", "auto, safetensors or dummy (random weights of a preset)")
    seed: int = _opt(0, "seed of a preset's random weights (v41.generate: --weight-seed; its --seed "
                        "seeds sampling)", aliases=("--weight-seed",))
    tensor_parallel_size: int = _opt(1, "tensor-parallel ranks, one process each (eager): query heads and "
                                        "whole routed experts split across them (v41/parallel.py)")
    pipeline_parallel_size: int = _opt(1, "pipeline-parallel ranks: only 1 (PP is not built in v41)")
    context_parallel_size: int = _opt(1, "context-parallel ranks: only 1 (CP is not built in v41)")
    kv_cache_dtype: str = _opt("bf16", f"main KV pool dtype: {' or '.join(KV_CACHE_DTYPES)}")
    index_cache_dtype: str = _opt("fp8", f"indexer key plane: {' or '.join(INDEX_CACHE_DTYPES)}")
    block_size: int | None = _opt(None, "PAGE tokens (the hash block): even, a multiple of every compress "
                                        "ratio, at least sliding_window - 1 and at least 32; default: "
                                        "the model's")
    max_num_seqs: int = _opt(32, "most requests in the running batch (= STATE slots)")
    max_num_batched_tokens: int = _opt(2048, "most tokens computed in one engine step")
    max_prefill_chunk: int | None = _opt(None, "most prompt tokens of one request per step (default: "
                                               "the step budget)")
    max_model_len: int | None = _opt(None, "longest prompt + completion (default: "
                                           "min(max_position_embeddings, 8192))")
    num_pages: int | None = _opt(None, "cache pages (default: every running request at max_model_len)")
    enable_prefix_caching: bool = _opt(True, "reuse the cache of full prompt PAGEs across requests")
    encoder_swa_bounded_replay: bool = _opt(True, "a prefix hit replays one hash block (off: checkpoint "
                                                  "images, copy mode)")
    num_images: int | None = _opt(None, "checkpoint images in copy mode (default: 4 per sequence)")
    # The one compile switch (-O/--compilation-level/--level is an alias; `compilation_level` below).
    enforce_eager: bool = _opt(True, "run the eager model; --no-enforce-eager (= -O3) compiles the "
                                     "forward with torch.compile (runtime/compile/)")
    decoder_swa_bounded_replay: bool = _opt(True, "compile the forward as _EarlyLayers/_LateLayers around "
                                                  "the boundary layer (off: one _Backbone graph)")
    compile_cache_dir: str | None = _opt(None, "root of the keyed compile caches (default: "
                                               "~/.cache/v41/compile; python -m v41.prebuild fills it)")
    capture_sizes: str | None = _opt(None, "token counts warmed up after compiling, e.g. 1,2,4,8,512 "
                                           "(default: 1,2,4,8 and max-num-batched-tokens)")
    cudagraph_mode: str | None = _opt(None, "NONE, FULL or TR_HYBRID: FULL replays a captured CUDA graph of the "
                                            "compiled forward for decode and DSpark verify steps that fit a "
                                            "captured width; "
                                            "TR_HYBRID replays token graphs of the compiled pieces between eager "
                                            "attention ops for any step that fits a token bucket (default: FULL "
                                            "on CUDA when compiled, else NONE)")
    cudagraph_capture_sizes: str | None = _opt(None, "FULL: widths in rows, e.g. 1,2,4,8 (default: 1, 2, 4, 8, "
                                                     "then every 8 up to max-num-seqs, at most 512: decode batch "
                                                     "sizes, and with DSpark 6 times each for verify steps); TR_HYBRID: "
                                                     "token buckets (default: powers of 2 up to 512 and "
                                                     "max-num-batched-tokens when at most 512)")
    gpu_memory_utilization: float = _opt(0.9, "share of the GPU's memory the engine may use: the KV pool gets "
                                              "what weights, activations, the graph pool and scratch leave "
                                              "(CUDA only; --num-pages wins)")
    dump_dir: str | None = _opt(None, "write graphs, each pass's graph before/after, match counts, "
                                      "Inductor output code and depyf's decompiled bytecode here")
    weight_format: str = _opt("dequant", "dequant: FP8/FP4 weights dequantized to --dtype once at load; native: "
                                         "kept FP8/FP4 and multiplied by the W8A8/W4A8 GEMMs (Triton on CUDA), "
                                         "about 2.5x less weight memory but slower GEMMs today (docs/weights.md)")
    speculative_method: str | None = _opt(None, "speculative decoding: dspark (V4.1's native five-token "
                                                "draft, docs/dspark.md; eager; greedy and sampled requests draft)",
                                          aliases=("--method",))
    num_speculative_tokens: int | None = _opt(None, "tokens drafted per verify step with --speculative-method "
                                                    "(DSpark drafts 5, the default)")
    spec_decode_acceptance_length: float | None = _opt(
        None, "BENCHMARK ONLY (ATOM's flag): every DSpark verify step commits this many tokens on average, "
              "1 + accepted drafts (1..k+1; floor/ceil accepted counts), whatever the target says, so random "
              "weights run at a given acceptance length (the recipe's 3.51); the tokens are not the model's. "
              "The server refuses it without --allow-benchmark-only")
    extra: dict = _opt({}, "not a flag")


class EngineArgs(_EngineFields):
    """Every engine setting (a dataclass: `fields`, `replace` and `asdict` work). One compile
    switch: `enforce_eager`. `compilation_level` is its alias: a constructor keyword (0 = eager,
    3 = compiled) and a read-only view, for runtime/compile/ and the `-O` flag."""

    def __init__(self, *args, compilation_level: int | None = None, **kw):
        super().__init__(*args, **kw)
        if compilation_level is not None:
            if compilation_level not in (0, 3):
                raise AdmissionError(f"compilation_level: {compilation_level} is not 0 (eager) or 3 "
                                     f"(compiled)")
            self.enforce_eager = compilation_level == 0

    @property
    def compilation_level(self) -> int:
        return 0 if self.enforce_eager else 3

    # ---- the CLI: one flag per field, in every entry point --------------------------------
    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, exclude: tuple = ()) -> list[str]:
        """Add one `--flag` per field (`--[no-]flag` for switches; help from the field), the
        `-O` alias of --[no-]enforce-eager, and the seed flags that are not built (refused by
        `from_cli_args`). `exclude`: option strings the caller uses otherwise (v41.generate's
        --seed). Returns the field names."""
        from runtime.cli import add_field_flags
        g = parser.add_argument_group("engine", "EngineArgs: the same flags in serve, generate and "
                                                "prebuild")
        names = add_field_flags(g, cls, exclude, actions={"enforce_eager": _EagerAction})
        g.add_argument("-O", "--compilation-level", "--level", dest="compilation_level", type=int,
                       choices=(0, 3), action=_LevelAction, default=None,
                       help="alias of the compile switch: 0 = --enforce-eager, 3 = --no-enforce-eager")
        nb = parser.add_argument_group("not built in v41 yet", "taken, and refused by name")
        for flag, what in NOT_BUILT.items():
            nb.add_argument(flag, dest=_nb_dest(flag), nargs="?", const=True, default=None,
                            metavar="VALUE", help=f"refused: {what} is not built in v41 yet")
        return names

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> "EngineArgs":
        """The settings of a parsed namespace; a not-built seed flag raises AdmissionError."""
        for flag, what in NOT_BUILT.items():
            v = getattr(ns, _nb_dest(flag), None)
            if v is not None:
                raise AdmissionError(f"{flag}: {what} is not built in v41 yet")
        return cls(**{f.name: getattr(ns, f.name) for f in fields(cls) if hasattr(ns, f.name)})

    def admit(self) -> tuple[V41Config, PoolGeometry]:
        """Check everything that does not need weights; raise AdmissionError/ConfigError."""
        if self.dtype not in DTYPES:
            raise AdmissionError(f"dtype: {self.dtype!r} is not one of {sorted(DTYPES)}")
        if self.load_format not in ("auto", "safetensors", "dummy"):
            raise AdmissionError(f"load_format: {self.load_format!r} is not auto, safetensors or dummy")
        if self.pipeline_parallel_size != 1:
            raise _not_built("--pipeline-parallel-size", self.pipeline_parallel_size, "pipeline parallelism")
        if self.context_parallel_size != 1:
            raise _not_built("--context-parallel-size", self.context_parallel_size, "context parallelism")
        if self.tensor_parallel_size < 1:
            raise AdmissionError(f"tensor_parallel_size: {self.tensor_parallel_size} (--tensor-parallel-size) "
                                 "is not a positive rank count")
        if self.weight_format not in ("dequant", "native"):
            raise AdmissionError(f"weight_format: {self.weight_format!r} (--weight-format) is not dequant or native")
        if self.weight_format == "native" and self.dtype == "float64":
            raise AdmissionError("weight_format='native' (--weight-format): float64 runs the dequantized "
                                 "reference arithmetic; use --weight-format dequant")
        self._admit_speculation()
        cfg = load_config(self.model)
        try:
            check_divisible(cfg, self.tensor_parallel_size)
        except ValueError as e:
            raise AdmissionError(f"{e} (--tensor-parallel-size)") from None
        if self.tensor_parallel_size > 1 and not self.enforce_eager:
            raise AdmissionError("tensor_parallel_size > 1 (--tensor-parallel-size) runs the eager model: "
                                 "all-reduces inside compiled graphs are not built; add --enforce-eager")
        if self.speculative_method is not None and cfg.n_draft < 1:
            raise AdmissionError(f"speculative_method='dspark' (--speculative-method): model {cfg.name} has no "
                                 f"DSpark draft stages (num_nextn_predict_layers = 0)")
        geo = PoolGeometry(cfg, self.block_size, self.index_cache_dtype, self.kv_cache_dtype,
                           DTYPES[self.dtype], n_draft=cfg.n_draft if self.speculative_method else 0)
        validate_page(cfg, geo.page_tokens, "block_size")
        ratio = max(geo.owners.values(), default=1)
        if geo.page_tokens < INDEX_ROWS_PER_BLOCK_ID * ratio:
            cut = "halves the PAGE" if ratio == 2 else f"keeps PAGE/{ratio} rows"
            raise AdmissionError(f"block_size={geo.page_tokens} (--block-size): a block id names "
                                 f"{INDEX_ROWS_PER_BLOCK_ID} index rows and a ratio-{ratio} owner {cut}, "
                                 f"so PAGE >= {INDEX_ROWS_PER_BLOCK_ID * ratio} tokens")
        if self.enable_prefix_caching and not self.encoder_swa_bounded_replay and geo.page_tokens < cfg.sliding_window:
            raise AdmissionError(f"block_size: checkpoint images (--no-encoder-swa-bounded-replay) need a PAGE of at "
                                 f"least the window ({cfg.sliding_window}); got {geo.page_tokens}")
        if self.max_model_len is not None and self.max_model_len > cfg.max_position_embeddings:
            raise AdmissionError(f"max_model_len: {self.max_model_len} exceeds max_position_embeddings "
                                 f"{cfg.max_position_embeddings}")
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise AdmissionError(f"{name} must be positive")
        if self.capture_sizes:
            from runtime.compile import parse_sizes
            try:
                parse_sizes(self.capture_sizes, self.max_num_batched_tokens)
            except ValueError as e:
                raise AdmissionError(str(e)) from None
        self.graph_sizes()
        if not 0 < self.gpu_memory_utilization <= 1:
            raise AdmissionError(f"gpu_memory_utilization: {self.gpu_memory_utilization} is not in (0, 1] "
                                 f"(--gpu-memory-utilization)")
        return cfg, geo

    @property
    def spec_tokens(self) -> int:
        """Tokens drafted per verify step: 0 without speculation."""
        return 0 if self.speculative_method is None else (self.num_speculative_tokens or 5)

    def _admit_speculation(self) -> None:
        """DSpark's refusals by name (docs/dspark.md §4)."""
        method, k, length = self.speculative_method, self.num_speculative_tokens, self.spec_decode_acceptance_length
        if method is None:
            if k is not None:
                raise AdmissionError(f"num_speculative_tokens={k} (--num-speculative-tokens) needs "
                                     f"--speculative-method dspark")
            if length is not None:
                raise AdmissionError(f"spec_decode_acceptance_length={length} (--spec-decode-acceptance-length) "
                                     f"needs --speculative-method dspark")
            return
        if method != "dspark":
            raise _not_built("--speculative-method", method, f"speculative method {method!r} (only dspark)")
        if k is not None and k != 5:
            raise AdmissionError(f"num_speculative_tokens={k} (--num-speculative-tokens): native DSpark "
                                 f"drafts five tokens")
        if length is not None and not 1 <= length <= 1 + self.spec_tokens:     # NaN fails both
            raise AdmissionError(f"spec_decode_acceptance_length={length} (--spec-decode-acceptance-length): the "
                                 f"mean tokens a verify step commits (1 + accepted drafts) is in "
                                 f"[1, {1 + self.spec_tokens}]")
        if self.kv_cache_dtype != "bf16":
            raise AdmissionError(f"kv_cache_dtype={self.kv_cache_dtype!r} (--kv-cache-dtype): DSpark runs on "
                                 f"the bf16 main pool (a packed/FP4 main pool with DSpark is refused)")

    def resolved_device(self) -> str:
        return self.device or ("cuda" if torch.cuda.is_available() else "cpu")

    def load_weights(self, cfg: V41Config):
        """The checkpoint's tensors as this engine runs them: `wo_a` stays FP8 under native
        weights, else it is dequantized to bf16 at load (spec §5.4)."""
        from v41.loader import load_weights
        return load_weights(self.model, cfg, device=self.resolved_device(), load_format=self.load_format,
                            seed=self.seed, wo_a="fp8" if self.weight_format == "native" else "bf16")

    def graph_mode(self) -> str:
        """The CUDA-graph mode this engine runs: the flag, or FULL on CUDA when compiled, else
        NONE. Graphs on the CPU or of the eager model are refused by name."""
        mode = self.cudagraph_mode
        cuda = torch.device(self.resolved_device()).type == "cuda"
        if mode is None:
            return "FULL" if cuda and not self.enforce_eager else "NONE"
        if mode not in CUDAGRAPH_MODES:
            raise AdmissionError(f"cudagraph_mode: {mode!r} (--cudagraph-mode) is not one of "
                                 f"{', '.join(CUDAGRAPH_MODES)}")
        if mode != "NONE" and not cuda:
            raise AdmissionError(f"cudagraph_mode={mode!r} (--cudagraph-mode): CUDA graphs need a CUDA device; "
                                 f"this engine runs on {self.resolved_device()} (use NONE)")
        if mode != "NONE" and self.enforce_eager:
            raise AdmissionError(f"cudagraph_mode={mode!r} (--cudagraph-mode) captures the compiled forward: "
                                 "add --no-enforce-eager (-O3)")
        return mode

    def graph_sizes(self) -> tuple:
        """The widths (rows) captured under FULL: decode batch sizes and, with DSpark, 1 + k
        times each (verify steps); token buckets under TR_HYBRID (the flag is validated even
        when graphs are off)."""
        mode = self.graph_mode()
        hybrid = mode == "TR_HYBRID"
        tokens, q = self.max_num_batched_tokens, 1 + self.spec_tokens
        top = tokens if hybrid or q > 1 else min(self.max_num_seqs, tokens)
        limit = "max_num_batched_tokens" if top == tokens else "min(max_num_seqs, max_num_batched_tokens)"
        spec = self.cudagraph_capture_sizes
        if spec:
            try:
                sizes = sorted({int(s) for s in spec.split(",") if s.strip()})
            except ValueError:
                raise AdmissionError(f"cudagraph_capture_sizes: {spec!r} (--cudagraph-capture-sizes) is not a "
                                     f"list of integers") from None
            bad = [s for s in sizes if not 1 <= s <= top]
            if bad or not sizes:
                raise AdmissionError(f"cudagraph_capture_sizes: {bad or spec!r} (--cudagraph-capture-sizes) not in "
                                     f"[1, {limit} = {top}]")
        elif hybrid:
            from runtime.token_graphs import token_buckets
            sizes = token_buckets(top)
        else:
            decode = set(self.decode_sizes())
            sizes = sorted(decode | {q * s for s in decode if q * s <= tokens})     # q = 1: decode alone
        return tuple(sizes) if mode != "NONE" else ()

    def decode_sizes(self) -> tuple:
        """Decode batch sizes graphed by default (FULL's widths without DSpark; the DSpark
        draft's request counts): 1, 2, 4, 8, then every 8 up to max_num_seqs, at most 512."""
        top = min(self.max_num_seqs, self.max_num_batched_tokens, 512)
        return tuple(sorted({s for s in (1, 2, 4, 8) if s <= top} | set(range(8, top + 1, 8)) | {top}))
