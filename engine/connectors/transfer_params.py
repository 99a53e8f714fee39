"""The shape and type check of a request's ``kv_transfer_params``.

Shared by the API server, the connector interface (``KVConnector.validate_kv_transfer_params``) and
the connectors; it lives apart from them so the interface and its implementations need not import
each other.
"""

from __future__ import annotations

from typing import Any, TypeGuard


def _is_int_list(x: Any) -> TypeGuard[list[int]]:
    return isinstance(x, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in x)


def check_kv_transfer_params(params: Any) -> str | None:
    """Why ``kv_transfer_params`` are malformed, or None if they are usable.

    The API server calls this to answer 400 instead of queueing a request the
    connector would only drop; connectors call it again and recompute on a bad one.
    """
    if params is None:
        return None
    if not isinstance(params, dict):
        return "kv_transfer_params must be an object"
    for flag in ("do_remote_decode", "do_remote_prefill"):
        if flag in params and not isinstance(params[flag], bool):
            return f"kv_transfer_params.{flag} must be a boolean"
    if params.get("do_remote_decode") and params.get("do_remote_prefill"):
        return "kv_transfer_params cannot ask for both do_remote_decode and do_remote_prefill"
    layout = params.get("remote_kv_layout")
    if layout is not None and (not isinstance(layout, str) or not 0 < len(layout) <= 200):
        return "kv_transfer_params.remote_kv_layout must be a short string (the sender's KV layout)"
    if not params.get("do_remote_prefill"):
        return None
    ids = params.get("remote_block_ids")
    if not _is_int_list(ids):
        return "kv_transfer_params.remote_block_ids must be a list of integers"
    if any(i < 0 for i in ids):
        return "kv_transfer_params.remote_block_ids must be non-negative"
    if len(set(ids)) != len(ids):
        return "kv_transfer_params.remote_block_ids has duplicates"
    if not ids:
        return None  # nothing to pull; the remaining fields do not matter
    for key in ("remote_engine_id", "remote_host", "remote_request_id", "remote_transfer_id"):
        if not isinstance(params.get(key), str) or not params.get(key):
            return f"kv_transfer_params.{key} must be a non-empty string"
    port = params.get("remote_port")
    if not isinstance(port, int) or isinstance(port, bool) or not (0 < port < 65536):
        return "kv_transfer_params.remote_port must be an integer in 1..65535"
    bs = params.get("remote_block_size")
    if bs is not None and (not isinstance(bs, int) or bs <= 0):
        return "kv_transfer_params.remote_block_size must be a positive integer"
    h = params.get("remote_block_hash")
    if h is not None and (not isinstance(h, str) or len(h) != 64):
        return "kv_transfer_params.remote_block_hash must be a 64-character hex string"
    return None
