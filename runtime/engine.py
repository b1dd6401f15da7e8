"""The engine: admission (every refusal before a weight is read), then the step loop
schedule -> run -> sample -> postprocess."""
from __future__ import annotations

import logging
import time

import numpy as np
import torch

from runtime import replay
from runtime.block_manager import BlockManager
from runtime.engine_args import DTYPES, EngineArgs
from runtime.model_runner import ModelRunner
from runtime.sampler import SamplingTable, sample, token_logprobs
from runtime.scheduler import Scheduler
from runtime.sequence import SamplingParams, Sequence, Status
from runtime.tensor_parallel import share_tokens
from v41.parallel import shard_checkpoint, tensor_parallel

log = logging.getLogger("v41")

class LLMEngine:
    def __init__(self, args: EngineArgs, weights=None):
        """`weights`: already loaded checkpoint tensors (tests share one load across engines)."""
        cfg, geo = args.admit()
        from v41.tokenizer import load_tokenizer
        self.args, self.cfg, self.geo = args, cfg, geo
        device = args.resolved_device()
        if torch.device(device).type == "cuda":
            import custom_ops.triton  # noqa: F401  (registers the CUDA kernels)
        from custom_ops import registry
        registry.log_selected(torch.device(device).type)
        self.driver = None
        if args.tensor_parallel_size > 1 and tensor_parallel().size == 1:    # rank 0: start the others
            from runtime.tensor_parallel import Driver
            self.driver = Driver(args)
        self.max_model_len = args.max_model_len or min(cfg.max_position_embeddings, 8192)
        self.tokenizer, token_map = load_tokenizer(args.model, cfg)
        t0 = time.perf_counter()
        if weights is None:
            weights = args.load_weights(cfg)
        if args.tensor_parallel_size > 1:
            weights = shard_checkpoint(cfg, weights, tensor_parallel().rank, args.tensor_parallel_size)
        pages_per_seq = -(-self.max_model_len // geo.page_tokens)
        # on CUDA without --num-pages the pool is sized from memory after a profiling forward on
        # a one-request pool; on the CPU every running request gets max_model_len
        sized = torch.device(device).type == "cuda" and args.num_pages is None
        num_pages = args.num_pages or (pages_per_seq if sized else args.max_num_seqs * pages_per_seq)
        copy = args.enable_prefix_caching and not args.encoder_swa_bounded_replay
        num_images = (args.num_images if args.num_images is not None else 4 * args.max_num_seqs) if copy else 0
        transfer = "copy" if copy else "replay"
        self.runner = ModelRunner(cfg, weights, geo, num_pages, args.max_num_seqs, args.max_num_seqs,
                                  args.max_num_batched_tokens, self.max_model_len, token_map, device,
                                  DTYPES[args.dtype], transfer, num_images, args.decoder_swa_bounded_replay,
                                  native_weights=args.weight_format == "native", spec_tokens=args.spec_tokens)
        del weights     # dequantized weights leave the checkpoint's FP8/FP4 tensors unreferenced: free them
        L = args.spec_decode_acceptance_length      # benchmark only: L tokens per verify step, L - 1 drafts
        if self.runner.spec is not None and L is not None:
            self.runner.spec.forced = L - 1
        graph_sizes = args.graph_sizes()
        self.pool_plan = None
        if sized:
            num_pages = self._size_pool(args, geo, graph_sizes, num_images, transfer)
        log.info("model %s ready on %s in %.1fs: num_pages %d of %d tokens%s, %d slots, cache %.1f MiB",
                 cfg.name, device, time.perf_counter() - t0, num_pages, geo.page_tokens,
                 " (sized from memory)" if sized else "", args.max_num_seqs, self.runner.cache.nbytes / 2**20)
        from runtime.compile import CompileConfig, compile_runner
        ccfg = CompileConfig.from_engine_args(args, args.max_num_batched_tokens)
        self.compile_report = compile_runner(self.runner, args, ccfg) if ccfg is not None else None
        self.graph_report = None
        if graph_sizes:
            from runtime.cuda_graph import graph_runner
            from runtime.memory import graph_pool_overrun
            graphs = graph_runner(args.graph_mode(), self.runner, graph_sizes)
            self.graph_report = graphs.capture()
            self.runner.graphs = graphs
            if self.runner.spec is not None:     # the DSpark draft, per request count
                from runtime.draft_graphs import DraftGraphRunner
                spec = self.runner.spec
                spec.graphs = DraftGraphRunner(spec, args.decode_sizes(), getattr(graphs, "pool", None))
                self.graph_report["draft"] = spec.graphs.capture()
            if self.pool_plan is not None and (warning := graph_pool_overrun(self.pool_plan, self.graph_report["pool_bytes"])):
                log.warning(warning)
        self.bm = BlockManager(num_pages, args.max_num_seqs, geo.page_tokens, pages_per_seq,
                               args.enable_prefix_caching, num_images)
        self.scheduler = Scheduler(self.bm, args.max_num_seqs, args.max_num_batched_tokens,
                                   cfg.eos_token_id, args.max_prefill_chunk, self.runner.state,
                                   speculative=self.runner.spec is not None)
        self.sampling_table = SamplingTable(args.max_num_seqs)    # per STATE slot
        self.seqs: dict[str, Sequence] = {}

    def _size_pool(self, args, geo, graph_sizes, num_images: int, transfer: str) -> int:
        """CUDA: measure weights and activation peaks on the one-request pool, plan the pool
        (runtime.memory.plan_pool) and allocate it; returns num_pages."""
        from custom_ops.triton.index import SCORE_BUDGET
        from runtime.memory import plan_pool, profile_cuda
        prof = profile_cuda(self.runner, args.max_num_batched_tokens, max(graph_sizes, default=1))
        if not graph_sizes:
            prof["graph_pool_bytes"] = 0
        # the index scorer's FP32 score tile: padding rows score nothing, so the profile misses it
        plan = plan_pool(**prof, utilization=args.gpu_memory_utilization, scorer_scratch=4 * SCORE_BUDGET,
                         bytes_per_page=geo.bytes_per_page, bytes_per_state=geo.bytes_per_state,
                         max_model_len=self.max_model_len, page_tokens=geo.page_tokens,
                         num_slots=args.max_num_seqs, bytes_per_image=geo.bytes_per_image, num_images=num_images)
        self.pool_plan = plan
        log.info("KV pool sized from memory: %s", {k: v for k, v in plan.summary().items()} | prof)
        self.runner.use_cache(plan.num_pages, args.max_num_seqs, num_images, transfer)
        return plan.num_pages

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
        seq.decoder_start = replay.decoder_start(seq.num_prompt_tokens, self.cfg.sliding_window,
                                                 self.args.decoder_swa_bounded_replay)
        seq.num_logprobs, seq.logprobs = logprobs, [] if logprobs is not None else None
        if logprobs is not None and self.runner.spec is not None:
            raise ValueError("logprobs with --speculative-method dspark are not built (logprobs of "
                             "speculative tokens)")
        if seq.request_id in self.seqs:
            raise ValueError(f"request id {seq.request_id!r} is already running")
        self.seqs[seq.request_id] = seq
        self.scheduler.add(seq)
        if self.driver is not None:
            self.driver.send("add", prompt_token_ids, params, seq.request_id, logprobs)
        return seq

    def set_decoder_replay(self, on: bool) -> None:
        """Decoder bounded replay on or off for the requests added from now on (teacher forcing
        and benchmarks switch it in one engine: the compiled split segments serve both, the
        decoder then running on every row)."""
        if self.has_unfinished():
            raise ValueError("switch decoder bounded replay with no request in the engine")
        self.args.decoder_swa_bounded_replay = self.runner.decoder_replay = on
        if self.driver is not None:
            self.driver.send("decoder_replay", on)

    def abort(self, request_id: str) -> bool:
        seq = self.scheduler.abort(request_id)
        self.seqs.pop(request_id, None)
        if self.driver is not None:
            self.driver.send("abort", request_id)
        return seq is not None

    def close(self) -> None:
        """Stop the tensor-parallel workers (a no-op for one rank)."""
        if self.driver is not None:
            self.driver.close()

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- the step --------------------------------------------------------------------------
    def step(self) -> list[Sequence]:
        """One engine step; returns the requests that got a token (finished ones included). A
        request whose own data makes sampling or its logprobs raise finishes alone, with
        finish_reason 'error' and `seq.error`; the rest of the batch goes on."""
        if self.driver is not None:
            self.driver.begin_step()
        sb = self.scheduler.schedule()
        if not sb.seqs:
            return []
        before = dict(self.runner.rows_run)
        # the final chunks' logits only: indexing by a host list would copy it to the device
        rows = self.runner.run(sb, final_only=True)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("step: %d requests, %d rows; encoder %d rows, decoder %d", len(sb.seqs), sb.scheduled_tokens,
                      *(self.runner.rows_run[k] - before[k] for k in ("encoder", "decoder")))
        final = self.runner.final_mask
        at = np.flatnonzero(final)          # the final requests' indices in the batch
        if final.all():
            seqs, slots = sb.seqs, sb.slots
        else:
            seqs, slots = [sb.seqs[i] for i in at.tolist()], sb.slots[at]
        verified = {}
        if self.runner.spec is not None and sb.spec:
            drafts = sb.drafts
            rows, verified = self.runner.spec.accept(rows, [drafts[i] for i in at], seqs, sb, at)
        if len(verified) == len(seqs):      # DSpark's steady state: acceptance chose every token
            toks, errors = [-1] * len(seqs), {}
        else:
            toks, errors = share_tokens(*self._sample(rows, seqs, slots, sb.steady))
        for j, (_, got) in verified.items():
            toks[j] = got           # the plain sample of the last row is not used
        lps = self._logprobs(rows, seqs, toks, errors)
        for j, msg in errors.items():
            self._fail(seqs[j], msg)
        if self.runner.spec is not None:
            self.runner.spec.commit(sb, {int(at[j]): a for j, (a, _) in verified.items() if j not in errors})
        self.scheduler.postprocess(sb, {s.seq_id: t for j, (s, t) in enumerate(zip(seqs, toks)) if j not in errors})
        if self.runner.spec is not None:
            self.runner.spec.propose([s for j, s in enumerate(seqs) if j not in errors])
        for s, lp in zip(seqs, lps):
            if lp is not None and len(s.logprobs) < len(s.completion_token_ids):
                s.logprobs.append(lp)
        for s in seqs:
            if s.status is Status.FINISHED:
                self.seqs.pop(s.request_id, None)
        return seqs

    def _sample(self, rows: torch.Tensor, seqs: list[Sequence], slots, steady: bool) -> tuple[list[int], dict[int, str]]:
        """The batch's tokens, and {row: error} for rows whose own data made the sampler raise:
        a failed batch is sampled again row by row (a row's token does not depend on the batch,
        so the others get the tokens the batch would have given them)."""
        eos = self.cfg.eos_token_id
        try:
            return sample(rows, seqs, eos, self.sampling_table, slots, steady), {}
        except Exception as e:  # noqa: BLE001 - find the rows that raise; the others go on
            # said once per failed batch: an error of the batched path itself would otherwise
            # only show as every step sampling row by row
            log.warning("sampling %d rows raised %s: %s; sampling them one by one", len(seqs), type(e).__name__, e)
            toks, errors = [], {}
            for j, seq in enumerate(seqs):
                try:
                    toks += sample(rows[j:j + 1], [seq], eos)
                except Exception as e:  # noqa: BLE001
                    toks.append(-1)
                    errors[j] = f"sampling failed: {type(e).__name__}: {e}"
            return toks, errors

    def _logprobs(self, rows: torch.Tensor, seqs: list[Sequence], toks: list[int],
                  errors: dict[int, str]) -> list:
        """Each row's (logprob, top-N) where its request asked for logprobs, else None; a row
        whose computation raises gets an entry in `errors`."""
        want = [j for j, s in enumerate(seqs) if s.logprobs is not None and j not in errors]
        out = [None] * len(seqs)
        if not want:
            return out
        try:
            got = token_logprobs(rows[want], [toks[j] for j in want], [seqs[j].num_logprobs for j in want])
            for j, lp in zip(want, got):
                out[j] = lp
        except Exception:  # noqa: BLE001 - again row by row
            for j in want:
                try:
                    out[j] = token_logprobs(rows[j:j + 1], [toks[j]], [seqs[j].num_logprobs])[0]
                except Exception as e:  # noqa: BLE001
                    errors[j] = f"logprobs failed: {type(e).__name__}: {e}"
        return out

    def _fail(self, seq: Sequence, msg: str) -> None:
        """Finish one request with an error: its pages and slot return at once."""
        log.warning("request %s failed: %s", seq.request_id, msg)
        self.scheduler.abort(seq.request_id)
        seq.finish_reason, seq.error = "error", msg
