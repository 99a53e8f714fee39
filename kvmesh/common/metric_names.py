"""Names of the series a kvmesh worker exports that other parts read: declared here once, used where
they are made (services/api/metrics.py) and where they are read (the router's load scrape, the
operator's planner and its Prometheus queries, the benchmarks). vLLM's names where vLLM has the
series, so vLLM-aware routers and dashboards read kvmesh pods too. Counters are exposed with
``_total`` and histograms with ``_bucket``/``_sum``/``_count`` after these names."""

from __future__ import annotations

NUM_REQUESTS_RUNNING = "vllm:num_requests_running"
NUM_REQUESTS_WAITING = "vllm:num_requests_waiting"
KV_CACHE_USAGE = "vllm:kv_cache_usage_perc"
PREFIX_CACHE_QUERIES = "vllm:prefix_cache_queries"
PREFIX_CACHE_HITS = "vllm:prefix_cache_hits"
REQUEST_SUCCESS = "vllm:request_success"
TIME_TO_FIRST_TOKEN = "vllm:time_to_first_token_seconds"
INTER_TOKEN_LATENCY = "vllm:inter_token_latency_seconds"
ENGINE_COMPUTED_TOKENS = "kvmesh:engine_computed_tokens"
KV_HELD_REQUESTS = "kvmesh:kv_held_requests"
PROMPT_TOKENS_PENDING = "kvmesh:prompt_tokens_pending"
# Prompts a worker turned into token ids, by source: "text" (it tokenized the prompt or rendered the chat
# itself) or "ids" (it took the ids the router computed, services/api/protocol.PROMPT_TOKEN_IDS).
PROMPT_TOKENIZATIONS = "kvmesh:prompt_tokenizations"
PROMPT_SOURCES = ("ids", "text")
# Requests a worker took as migrations (services/errors.MIGRATED_HEADER): another pod's admitted work,
# which the queue deadline does not shed.
MIGRATED_REQUESTS = "kvmesh:migrated_requests"


def total(name: str) -> str:
    """The sample name of counter ``name``."""
    return name + "_total"


def bucket(name: str) -> str:
    """The sample name of histogram ``name``'s buckets."""
    return name + "_bucket"


# LoRA: vLLM's info gauge (labels max_lora, running_lora_adapters, waiting_lora_adapters; value: the time
# it was set), read by LoRA-aware routers, and kvmesh's registered adapters (label lora_name, value 1).
LORA_REQUESTS_INFO = "vllm:lora_requests_info"
LORA_ADAPTER_INFO = "kvmesh:lora_adapter_info"
# The pod's KV-block layout id (label layout; value 1): what a P/D transfer needs equal on both sides.
KV_LAYOUT_INFO = "kvmesh:kv_layout_info"
# The digest of the worker's tokenizer (kvmesh.common.model_files.tokenizer_digest; value 1): a router sends
# the prompt ids it computed (services/api/protocol.PROMPT_TOKEN_IDS) only to pods that export its own.
TOKENIZER_INFO = "kvmesh:tokenizer_info"
