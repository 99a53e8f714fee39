"""OpenAI request bodies (pydantic), with vLLM's extras.

Only the shape is checked here; value ranges are checked once, by
`SamplingParams`, so the offline and served paths reject the same inputs with
the same messages. Unknown fields are ignored, as OpenAI and vLLM do. Types are
strict, as OpenAI's are: ``"max_tokens": "10"`` or ``"stream": "yes"`` is a 400,
not a coercion (an integer is still a valid float).

The router validates request bodies with these same models and declares them in
its OpenAPI schema, so a client sees the same 400 before or behind the router.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from pydantic.json_schema import SkipJsonSchema

from kvmesh.services.errors import bad_request

# Default of --max-request-tokens (API server and router): how many tokens one request may ask to
# generate over all its sequences (prompts x n x max_tokens). vLLM has no such bound; without one a
# single request (n=100, max_tokens=8000) holds a pod for minutes. A single sequence may always run to
# the end of its context, so the limit in force is never below max_model_len.
DEFAULT_MAX_REQUEST_TOKENS = 65536

# The router's private body field (never a client's: the router refuses a request that carries it):
# the prompt's token ids as the router computed them to hash its blocks, so the prefill and decode pods
# take them instead of tokenizing the prompt again. Its value is `PromptTokenIds`.
PROMPT_TOKEN_IDS = "kvmesh_prompt_token_ids"


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True)

    include_usage: bool = False
    continuous_usage_stats: bool = False


class PromptTokenIds(BaseModel):
    """The value of `PROMPT_TOKEN_IDS`: a single prompt's ids (a completions text prompt, or a chat rendered
    by `kvmesh.common.chat` as the API server renders it) and the digest of the tokenizer that made them
    (`kvmesh.common.model_files.tokenizer_digest`): a pod takes them only when its own tokenizer's digest
    is the same, and validates them as it validates a token-id prompt."""

    model_config = ConfigDict(extra="forbid", strict=True)

    tokenizer: str
    ids: list[int]


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    max_tokens: int | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    response_format: dict[str, Any] | None = None  # text, json_object, json_schema (services/api/constraints.py)
    structured_outputs: dict[str, Any] | None = None  # vLLM's: one of json, regex, choice, grammar
    user: str | None = None
    # vLLM extras, passed through to the engine
    cache_salt: str | None = None
    kv_transfer_params: dict[str, Any] | None = None
    # vLLM's: the answer carries the prompt's token ids (``prompt_token_ids``) and each choice's generated
    # ones (``token_ids``, per streamed chunk too). The router asks for them to migrate a broken stream
    # (services/router/migration.py).
    return_token_ids: bool | None = None
    # `PROMPT_TOKEN_IDS` (the router's, kept out of the OpenAPI schema: no client is meant to send it)
    router_prompt_ids: SkipJsonSchema[PromptTokenIds | None] = Field(default=None, validation_alias=PROMPT_TOKEN_IDS)


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None  # services/api/tools.py
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = None
    tokens: list[int]


def check_context(prompt_len: int, max_model_len: int | None) -> None:
    """A 400 for a prompt that leaves no room for one generated token: the API server's check, which the
    router makes too after its own tokenization, so such a request never reaches a queue or a pod."""
    if max_model_len and prompt_len >= max_model_len:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, your request has "
            f"{prompt_len} input tokens; the prompt must leave room for at least one generated token.",
            "prompt",
        )


def completion_tokens(max_tokens: int | None, prompt_len: int, max_model_len: int | None) -> int:
    """The tokens one sequence may generate: ``max_tokens``, or when unset the context left
    (``max_model_len - prompt``), as vLLM generates to the end of the context then. Every budget
    (the request limit below, the router's admission and TPM charge) counts it this way."""
    if isinstance(max_tokens, int) and not isinstance(max_tokens, bool) and max_tokens > 0:
        return max_tokens
    if max_tokens is None and max_model_len:
        return max(0, max_model_len - prompt_len)
    return 0


def check_request_tokens(
    n: int, num_prompts: int, max_tokens: int | None, prompt_len: int, max_model_len: int | None, limit: int
) -> int:
    """The request's generation budget, ``prompts x n x completion_tokens``; a request over the limit
    (``limit`` raised to ``max_model_len``; 0: no limit) gets a 400 naming the parameter and by how much,
    never a rate limit's 429: no wait would ever admit it. The API server and the router both call
    this, so a client gets the same answer from either."""
    per_seq = completion_tokens(max_tokens, prompt_len, max_model_len)
    seqs = max(1, n) * max(1, num_prompts)
    total = seqs * per_seq
    cap = max(limit, max_model_len or 0)
    if limit > 0 and total > cap:
        what = "max_tokens" if max_tokens is not None else f"max_tokens (unset: the context left, {per_seq})"
        shape = f"n={n} x {what}" if num_prompts <= 1 else f"{num_prompts} prompts x n={n} x {what}"
        raise bad_request(
            f"the request may generate {total} tokens ({shape}), over this server's limit of {cap} tokens "
            f"per request by {total - cap} (--max-request-tokens); lower n or max_tokens",
            "max_tokens",
        )
    return total


class LoadLoRAAdapterRequest(BaseModel):
    """vLLM's body of ``POST /v1/load_lora_adapter``."""

    model_config = ConfigDict(extra="ignore", strict=True)
    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1, max_length=4096)
    load_inplace: bool = False  # an adapter of that name is replaced instead of refused


class UnloadLoRAAdapterRequest(BaseModel):
    """vLLM's body of ``POST /v1/unload_lora_adapter``."""

    model_config = ConfigDict(extra="ignore", strict=True)
    lora_name: str = Field(min_length=1, max_length=256)
    lora_int_id: int | None = None  # vLLM's body may carry it; names identify adapters here
