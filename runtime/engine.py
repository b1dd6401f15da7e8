"""The engine: admission (every refusal before a weight is read), then the step loop
schedule -> run -> sample -> postprocess."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from runtime.block_manager import BlockManager
from runtime.geometry import AdmissionError, PoolGeometry
from runtime.model_runner import ModelRunner
from runtime.sampler import sample, token_logprobs
from runtime.scheduler import Scheduler
from runtime.sequence import SamplingParams, Sequence, Status
from v41.config import ConfigError, V41Config, load_config, validate_page

log = logging.getLogger("v41")

DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32,
          "fp32": torch.float32, "float64": torch.float64}


@dataclass
class EngineArgs:
    model: str = "toy"
    dtype: str = "bfloat16"
    device: str | None = None                 # default: cuda when available
    load_format: str = "auto"                 # auto | safetensors | dummy
    seed: int = 0                             # random-weight seed of a preset
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    context_parallel_size: int = 1
    kv_cache_dtype: str = "bf16"
    index_cache_dtype: str = "fp8"
    block_size: int | None = None             # PAGE tokens; default: the preset's
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 2048
    max_prefill_chunk: int | None = None      # per-request chunk cap (default: the step budget)
    max_model_len: int | None = None
    num_pages: int | None = None              # default: every running request at max_model_len
    enable_prefix_caching: bool = True
    encoder_swa_bounded_replay: bool = True   # prefix hits replay one hash block; False: checkpoint images
    num_images: int | None = None             # checkpoint images (copy mode); default 4 per sequence
    enforce_eager: bool = True                # eager model; False: compile (compilation_level 3)
    compilation_level: int = 3                # 0: no torch.compile, 3: compiled segments (runtime/compile.py)
    decoder_swa_bounded_replay: bool = True   # graphs _EarlyLayers/_LateLayers; False: one _Backbone
    compile_cache_dir: str | None = None      # keyed compile caches (default ~/.cache/v41/compile)
    capture_sizes: str | None = None          # token counts warmed after compiling, e.g. "1,2,4,8,512"
    dump_dir: str | None = None               # graphs, passes before/after, output code, depyf
    speculative_method: str | None = None
    extra: dict = field(default_factory=dict)

    def admit(self) -> tuple[V41Config, PoolGeometry]:
        """Check everything that does not need weights; raise AdmissionError/ConfigError."""
        if self.dtype not in DTYPES:
            raise AdmissionError(f"dtype: {self.dtype!r} is not one of {sorted(DTYPES)}")
        if self.load_format not in ("auto", "safetensors", "dummy"):
            raise AdmissionError(f"load_format: {self.load_format!r} is not auto, safetensors or dummy")
        if self.pipeline_parallel_size != 1 or self.context_parallel_size != 1:
            raise AdmissionError("pipeline/context parallelism is not supported by DeepSeek-V4.1 serving")
        if self.tensor_parallel_size != 1:
            raise AdmissionError("tensor_parallel_size: only 1 is built so far")
        if self.speculative_method is not None:
            raise AdmissionError(f"speculative method {self.speculative_method!r}: DSpark speculation "
                                 f"is not built yet")
        cfg = load_config(self.model)
        geo = PoolGeometry(cfg, self.block_size, self.index_cache_dtype, self.kv_cache_dtype,
                           DTYPES[self.dtype])
        validate_page(cfg, geo.page_tokens, "block_size")
        if self.enable_prefix_caching and not self.encoder_swa_bounded_replay and geo.page_tokens < cfg.sliding_window:
            raise AdmissionError(f"block_size: checkpoint images (--no-encoder-swa-bounded-replay) need a PAGE of at "
                                 f"least the window ({cfg.sliding_window}); got {geo.page_tokens}")
        if self.max_model_len is not None and self.max_model_len > cfg.max_position_embeddings:
            raise AdmissionError(f"max_model_len: {self.max_model_len} exceeds max_position_embeddings "
                                 f"{cfg.max_position_embeddings}")
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise AdmissionError(f"{name} must be positive")
        if self.compilation_level not in (0, 3):
            raise AdmissionError(f"compilation_level: {self.compilation_level} is not 0 (eager) or 3 (compiled)")
        if self.capture_sizes:
            from runtime.compile import parse_sizes
            try:
                parse_sizes(self.capture_sizes, self.max_num_batched_tokens)
            except ValueError as e:
                raise AdmissionError(str(e)) from None
        return cfg, geo


class LLMEngine:
    def __init__(self, args: EngineArgs, weights=None):
        """`weights`: already loaded checkpoint tensors (tests share one load across engines)."""
        cfg, geo = args.admit()
        from v41.loader import load_weights
        from v41.tokenizer import load_tokenizer
        self.args, self.cfg, self.geo = args, cfg, geo
        device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        if torch.device(device).type == "cuda":
            import custom_ops.triton  # noqa: F401  (registers the CUDA kernels)
        from custom_ops import registry
        registry.log_selected(torch.device(device).type)
        self.max_model_len = args.max_model_len or min(cfg.max_position_embeddings, 8192)
        self.tokenizer, token_map = load_tokenizer(args.model, cfg)
        t0 = time.perf_counter()
        if weights is None:
            weights = load_weights(args.model, cfg, device=device, load_format=args.load_format,
                                   seed=args.seed)
        pages_per_seq = -(-self.max_model_len // geo.page_tokens)
        num_pages = args.num_pages or args.max_num_seqs * pages_per_seq
        copy = args.enable_prefix_caching and not args.encoder_swa_bounded_replay
        num_images = (args.num_images if args.num_images is not None else 4 * args.max_num_seqs) if copy else 0
        self.runner = ModelRunner(cfg, weights, geo, num_pages, args.max_num_seqs, args.max_num_seqs,
                                  args.max_num_batched_tokens, self.max_model_len, token_map, device,
                                  DTYPES[args.dtype], "copy" if copy else "replay", num_images)
        log.info("model %s ready on %s in %.1fs: %d pages of %d tokens, %d slots, cache %.1f MiB",
                 cfg.name, device, time.perf_counter() - t0, num_pages, geo.page_tokens,
                 args.max_num_seqs, self.runner.cache.nbytes / 2**20)
        from runtime.compile import CompileConfig, compile_runner
        ccfg = CompileConfig.from_engine_args(args, args.max_num_batched_tokens)
        self.compile_report = compile_runner(self.runner, args, ccfg) if ccfg is not None else None
        self.bm = BlockManager(num_pages, args.max_num_seqs, geo.page_tokens, pages_per_seq,
                               args.enable_prefix_caching, num_images)
        self.scheduler = Scheduler(self.bm, args.max_num_seqs, args.max_num_batched_tokens,
                                   cfg.eos_token_id, args.max_prefill_chunk, self.runner.state)
        self.seqs: dict[str, Sequence] = {}

    # ---- requests ------------------------------------------------------------------------
    def add_request(self, prompt_token_ids: list[int], params: SamplingParams,
                    request_id: str | None = None, logprobs: int | None = None) -> Sequence:
        """`logprobs`: opt-in; N >= 0 fills `seq.logprobs` with one (logprob of the sampled token,
        top-N [(token id, logprob)]) per completion token."""
        if not prompt_token_ids:
            raise ValueError("prompt is empty")
        if len(prompt_token_ids) + params.max_tokens > self.max_model_len:
            raise ValueError(f"prompt of {len(prompt_token_ids)} tokens + max_tokens {params.max_tokens} "
                             f"exceeds max_model_len {self.max_model_len}")
        bad = [t for t in prompt_token_ids if not 0 <= t < self.cfg.vocab_size]
        if bad:
            raise ValueError(f"token ids out of range [0, {self.cfg.vocab_size}): {bad[:5]}")
        seq = Sequence(prompt_token_ids, params, request_id)
        seq.num_logprobs, seq.logprobs = logprobs, [] if logprobs is not None else None
        if seq.request_id in self.seqs:
            raise ValueError(f"request id {seq.request_id!r} is already running")
        self.seqs[seq.request_id] = seq
        self.scheduler.add(seq)
        return seq

    def abort(self, request_id: str) -> bool:
        seq = self.scheduler.abort(request_id)
        self.seqs.pop(request_id, None)
        return seq is not None

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- the step --------------------------------------------------------------------------
    def step(self) -> list[Sequence]:
        """One engine step; returns the requests that got a token (finished ones included)."""
        sb = self.scheduler.schedule()
        if not sb.seqs:
            return []
        logits = self.runner.run(sb)
        final = [i for i, f in enumerate(sb.is_final_chunk) if f]
        toks = sample(logits[final], [sb.seqs[i] for i in final]) if final else []
        self.scheduler.postprocess(sb, {sb.seqs[i].seq_id: t for i, t in zip(final, toks)})
        out = [sb.seqs[i] for i in final]
        for i, tok in zip(final, toks):
            seq = sb.seqs[i]
            if seq.logprobs is not None and len(seq.logprobs) < len(seq.completion_token_ids):
                seq.logprobs.append(token_logprobs(logits[i:i + 1], [tok], [seq.num_logprobs])[0])
        for s in out:
            if s.status is Status.FINISHED:
                self.seqs.pop(s.request_id, None)
        return out
