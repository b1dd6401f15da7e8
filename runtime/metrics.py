"""The serving metrics of `python -m v41.serve`, through `prometheus_client` (as vLLM and SGLang
expose theirs), in Prometheus text format 0.0.4.

Each `ServingMetrics` has its own `CollectorRegistry`, so several servers (or test apps) in one
process do not collide. `prometheus_client` metrics are thread-safe: the engine thread observes,
the HTTP thread renders.
"""
from __future__ import annotations

import threading

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# `_created` samples (a counter's or histogram's creation time) are OpenMetrics, not what
# vLLM's /metrics shows or what a 0.0.4 scraper needs. Process-wide: prometheus_client has no
# per-registry switch.
prometheus_client.disable_created_metrics()

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"    # what generate_latest writes

_LATENCY = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
            7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
_TPOT = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
         10.0, 20.0, 40.0, 80.0]
_TOKENS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000]


class ServingMetrics:
    """What `GET /metrics` shows. Names follow vLLM's with a `v41:` prefix; every series carries
    the served model name. The attributes are the model's series (prometheus_client children
    bound to `model_name`): `.set()`, `.inc()`, `.observe()` as usual; `requests` is the family,
    labelled by `finished_reason` through `finished()`."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        r = self.registry = CollectorRegistry()

        def g(name, help):
            return Gauge(name, help, ("model_name",), registry=r).labels(model_name)

        def c(name, help):
            return Counter(name, help, ("model_name",), registry=r).labels(model_name)

        def h(name, help, buckets):
            return Histogram(name, help, ("model_name",), buckets=buckets, registry=r).labels(model_name)

        self.running = g("v41:num_requests_running", "Requests in the running batch.")
        self.waiting = g("v41:num_requests_waiting", "Requests waiting to be scheduled.")
        self.page_usage = g("v41:kv_cache_usage_perc", "Fraction of cache pages held by requests (1 = full).")
        self.slot_usage = g("v41:state_slot_usage_perc",
                            "Fraction of STATE slots held by running requests (1 = full).")
        self.pages_free = g("v41:num_free_pages", "Cache pages on the free list.")
        self.pages_total = g("v41:num_pages", "Cache pages in the pool.")
        self.slots_free = g("v41:num_free_slots", "STATE slots on the free list.")
        self.slots_total = g("v41:num_slots", "STATE slots in the pool.")
        self.prefix_hit_rate = g("v41:prefix_cache_hit_rate",
                                 "Prompt tokens served from the prefix cache / prompt tokens (since start).")
        self.prefix_queries = c("v41:prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = c("v41:prefix_cache_hits_total", "Prompt tokens served from the prefix cache.")
        self.cached_pages = g("v41:prefix_cache_pages", "Cached pages no request holds (evictable).")
        self.images_stored = g("v41:checkpoint_images_stored", "Checkpoint images written (copy mode).")
        self.images_restored = g("v41:checkpoint_images_restored", "Checkpoint images restored into a slot.")
        self.images_refused = g("v41:checkpoint_images_refused",
                                "Images refused (another geometry, position or altered bytes).")
        self.replayed_rows = g("v41:prefix_replayed_rows",
                               "Rows recomputed below prefix hits (replay start or image boundary).")
        self.encoder_rows = g("v41:encoder_rows", "Rows the encoder has run (every scheduled row), since start.")
        self.decoder_rows = g("v41:decoder_rows", "Rows the decoder has run, since start: under decoder bounded "
                                                  "replay each prompt's tail and the decode rows.")
        self.prompt_tokens = c("v41:prompt_tokens_total", "Prefill tokens processed.")
        self.generation_tokens = c("v41:generation_tokens_total", "Generated tokens.")
        self.preemptions = c("v41:num_preemptions_total", "Requests preempted.")
        self.steps = c("v41:engine_steps_total", "Engine steps run.")
        self.requests = Counter("v41:request_success_total",
                                "Finished requests by finish reason (abort = cancelled).",
                                ("model_name", "finished_reason"), registry=r)
        self.invariant_failures = c("v41:block_manager_check_failures_total",
                                    "Block manager invariant checks that failed.")
        self.ttft = h("v41:time_to_first_token_seconds", "Time to first token.", _LATENCY)
        self.tpot = h("v41:time_per_output_token_seconds",
                      "Mean time per output token after the first, per request.", _TPOT)
        self.itl = h("v41:inter_token_latency_seconds", "Time between consecutive tokens of a request.", _TPOT)
        self.e2e = h("v41:e2e_request_latency_seconds",
                     "End-to-end request latency (arrival to last token).", _LATENCY)
        self.queue_time = h("v41:request_queue_time_seconds", "Arrival to first scheduled step.", _LATENCY)
        self.prompt_len = h("v41:request_prompt_tokens", "Prompt length of requests.", _TOKENS)
        self.gen_len = h("v41:request_generation_tokens", "Generated tokens per request.", _TOKENS)
        # DSpark (docs/dspark.md §6): counted from SpecStep.stats by `spec_decode`
        self.spec_drafts = c("v41:spec_decode_num_drafts_total", "Draft blocks verified (DSpark).")
        self.spec_draft_tokens = c("v41:spec_decode_num_draft_tokens_total", "Drafted tokens verified.")
        self.spec_accepted = c("v41:spec_decode_num_accepted_tokens_total", "Drafted tokens accepted.")
        self.spec_accepted_per_pos = Counter("v41:spec_decode_num_accepted_tokens_per_pos_total",
                                             "Drafts whose token at this position (0-based) was accepted.",
                                             ("model_name", "position"), registry=r)
        self.spec_acceptance_length = h("v41:spec_decode_acceptance_length",
                                        "Tokens a verify step commits (1 + accepted drafts).", [1, 2, 3, 4, 5, 6])
        self._spec_seen = None
        for reason in ("stop", "length", "abort"):       # shown at zero from the start
            self.requests.labels(model_name, reason)
        # the hit rate is derived at scrape time from the two counts `prefix_lookup` keeps
        self._lock = threading.Lock()
        self._queries = self._hits = 0
        self.prefix_hit_rate.set_function(self._hit_rate)

    def finished(self, reason: str) -> None:
        self.requests.labels(self.model_name, reason).inc()

    def prefix_lookup(self, queries: int, hits: int) -> None:
        """A request's prompt tokens looked up in the prefix cache, and those it found there."""
        with self._lock:
            self._queries += queries
            self._hits += hits
        self.prefix_queries.inc(queries)
        self.prefix_hits.inc(hits)

    def spec_decode(self, stats: dict) -> None:
        """Advance the DSpark series to the engine's cumulative counts (runtime.spec_step.SpecStep.stats)."""
        seen = self._spec_seen or {"drafts": 0, "draft_tokens": 0, "accepted": 0,
                                   "accepted_per_pos": [0] * len(stats["accepted_per_pos"]),
                                   "acceptance_length": [0] * len(stats["acceptance_length"])}
        for key, series in (("drafts", self.spec_drafts), ("draft_tokens", self.spec_draft_tokens),
                            ("accepted", self.spec_accepted)):
            series.inc(stats[key] - seen[key])
        for i, (now, was) in enumerate(zip(stats["accepted_per_pos"], seen["accepted_per_pos"])):
            self.spec_accepted_per_pos.labels(self.model_name, str(i)).inc(now - was)
        for length, (now, was) in enumerate(zip(stats["acceptance_length"], seen["acceptance_length"])):
            for _ in range(now - was):
                self.spec_acceptance_length.observe(length)
        self._spec_seen = {k: list(v) if isinstance(v, list) else v for k, v in stats.items()}

    def _hit_rate(self) -> float:
        with self._lock:
            return self._hits / self._queries if self._queries else 0.0

    def render(self) -> str:
        return generate_latest(self.registry).decode()


def parse(text: str) -> dict[str, float]:
    """Prometheus text -> {'name{labels}': value}, the labels as written (prometheus_client
    sorts them by name); for tests and the benchmark."""
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, val = line.rpartition(" ")
        out[key] = float(val)
    return out
