"""The Prometheus metrics ``/metrics`` exposes, in a registry of their own (two
servers in one process never share counters). The engine thread updates them;
prometheus_client's metrics are thread-safe."""

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

CONTENT_TYPE = CONTENT_TYPE_LATEST


class Metrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.running = Gauge("cellcache_requests_running",
                             "Requests admitted into the cache (prefilling or decoding)",
                             registry=r)
        self.waiting = Gauge("cellcache_requests_waiting",
                             "Requests waiting for admission", registry=r)
        self.cells_in_use = Gauge("cellcache_cells_in_use",
                                  "KV cache cells requests hold (those only cached prefixes "
                                  "hold: cellcache_prefix_cache_cells)", registry=r)
        self.cells_total = Gauge("cellcache_cells_total", "KV cache cells of the program",
                                 registry=r)
        self.prompt_tokens = Counter("cellcache_prompt_tokens",
                                     "Prompt tokens prefilled", registry=r)
        self.generated_tokens = Counter("cellcache_generation_tokens",
                                        "Tokens generated", registry=r)
        self.steps = Counter("cellcache_steps", "Forwards run (one step each)", registry=r)
        self.requests = Counter("cellcache_requests", "Requests finished, by finish reason",
                                ["finish_reason"], registry=r)
        self.prefix_requests = Counter("cellcache_prefix_cache_requests",
                                       "Requests admitted while the prefix cache is on",
                                       registry=r)
        self.prefix_hits = Counter("cellcache_prefix_cache_hits",
                                   "Requests that reused at least one cached prompt token",
                                   registry=r)
        self.prefix_cached_tokens = Counter("cellcache_prefix_cache_cached_tokens",
                                            "Prompt tokens served from cached cells, not "
                                            "prefilled", registry=r)
        self.prefix_evictions = Counter("cellcache_prefix_cache_evictions",
                                        "Cached sequences evicted (for room or the bound)",
                                        registry=r)
        self.prefix_hit_rate = Gauge("cellcache_prefix_cache_hit_rate",
                                     "prefix_cache_hits / prefix_cache_requests", registry=r)
        self.prefix_cells = Gauge("cellcache_prefix_cache_cells",
                                  "KV cache cells held only by cached sequences", registry=r)
        self.rejected = Counter("cellcache_requests_rejected",
                                "Requests refused because the wait queue was full (429)",
                                registry=r)
        self.spec_proposed = Counter("cellcache_speculative_proposed_tokens",
                                     "Speculative decoding: tokens proposed and verified",
                                     registry=r)
        self.spec_accepted = Counter("cellcache_speculative_accepted_tokens",
                                     "Speculative decoding: proposed tokens accepted",
                                     registry=r)
        self.spec_tokens_per_forward = Gauge(
            "cellcache_speculative_tokens_per_forward",
            "Tokens a decoding sample gains per forward it takes part in (1 without "
            "speculation)", registry=r)
        self.spec_max_draft = Gauge(
            "cellcache_speculative_max_draft",
            "Most tokens proposed per sample and step (--draft-max, or chosen from measured "
            "step costs when auto); 0 without speculation", registry=r)
        self.spec_draft_failed = Gauge(
            "cellcache_speculative_draft_failed",
            "1 once the draft model failed: the server decodes without proposals from then on "
            "(the error is in its log)", registry=r)

    def text(self) -> bytes:
        return generate_latest(self.registry)
