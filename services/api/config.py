"""Frozen configuration of one API server (one pod of any role).

Each setting is declared once, as a field: its default is the field's and its flag and help travel in
the field's metadata (kvmesh.common.fields), so `kvmesh serve|prefill|decode` generate their flags
from these fields (services/api/entry.py) and tests build the same object directly.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvmesh.common.fields import cli
from kvmesh.common.roles import Role
from kvmesh.services.api.protocol import DEFAULT_MAX_REQUEST_TOKENS
from kvmesh.services.http_server import DEFAULT_HEADER_TIMEOUT

ADDRESS = "address"  # the flags before the engine's server flags (--role, --max-waiting, --engine-id) in --help


def _flag(default, help: str | None = None, **cli_kw):
    return field(default=default, metadata=cli(help, **cli_kw))


@dataclass(frozen=True)
class ServerConfig:
    host: str = _flag("0.0.0.0", section=ADDRESS)
    # 0: the kernel picks one when uvicorn binds (nothing can take it first)
    port: int = _flag(8000, "0: a free port the kernel picks (see --ready-file)", section=ADDRESS)
    # Written once uvicorn listens ({"url", "port", "pid"}; renamed into place, removed on exit): how
    # a parent learns the port of ``port`` 0 and that the server is up (`kvmesh up`).
    ready_file: str | None = _flag(
        None,
        'once listening, write {"url", "port", "pid"} here (atomically; removed on exit): '
        "how a parent learns the port of --port 0",
        section=ADDRESS,
        metavar="PATH",
    )
    # what the engine runs as (checked by the CLI and the engine; its flag is EngineArgs'); the API is the same
    role: Role = "both"
    served_model_names: tuple[str, ...] = _flag(
        (), "name(s) clients use in `model` (default: the model's name)", flag="--served-model-name", nargs="+"
    )
    # Accepted API keys (services/auth.py): every endpoint but /health, /live and /metrics needs one
    # when any is set. Empty and no file: $KVMESH_API_KEY / $KVMESH_API_KEYS_FILE, else open.
    api_keys: tuple[str, ...] = _flag(
        (),
        "require `Authorization: Bearer KEY` on all endpoints but /health, /live and /metrics "
        "(repeatable; default: $KVMESH_API_KEY, comma-separated)",
        flag="--api-key",
        action="append",
        metavar="API_KEY",
    )
    # JSON list of {key, tenant, priority, rpm, tpm}, re-read on change
    api_keys_file: str | None = _flag(
        None,
        "JSON list of {key, tenant, priority, rpm, tpm}, re-read when it changes (default: $KVMESH_API_KEYS_FILE)",
    )
    # LoRA adapters kept equal to a file (services/api/lora_sync.py): the operator's spec.loraAdapters
    # reaches running pods through it, from a ConfigMap mount
    lora_modules_file: str | None = _flag(
        None,
        'JSON {"adapters": {NAME: PATH}}: the LoRA adapters to serve, loaded before serving and kept equal to '
        "the file (re-read every 2 s: added ones loaded, removed ones unloaded, changed ones reloaded); "
        "needs --enable-lora",
        metavar="PATH",
    )
    # The admin credential (services/auth.py): /drain and /reset_prefix_cache take it, never a client's key.
    admin_key: str | None = field(
        default=None,
        repr=False,  # a secret: never in a logged config
        metadata=cli(
            "the admin credential, distinct from --api-key: /drain and /reset_prefix_cache take it "
            "(default: $KVMESH_ADMIN_KEY; none while keys are configured: they are refused)"
        ),
    )
    admin_key_file: str | None = _flag(
        None, "file holding the admin key, re-read when it changes (instead of --admin-key)", metavar="PATH"
    )
    max_body_bytes: int = _flag(8 << 20, "larger request bodies get 413")
    # services/api/protocol.py check_request_tokens; the router has the same flag and default.
    max_request_tokens: int = _flag(
        DEFAULT_MAX_REQUEST_TOKENS,
        "tokens one request may ask to generate over all its sequences (prompts x n x max_tokens; an unset "
        "max_tokens counts as the context left); more is a 400. Never below max_model_len (0: no limit)",
    )
    # how `auto` tool calls are read from the output (services/api/tools.py PARSERS); None: from the chat template
    tool_call_parser: str | None = _flag(
        None,
        "how tool calls are read from a model's output with tool_choice auto (default: from the chat template)",
        choices=("hermes", "llama3_json"),
    )
    body_timeout: float = _flag(30.0, "seconds for a request body to arrive in full; a slower client gets 408")
    header_timeout: float = _flag(  # services/http_server.py
        DEFAULT_HEADER_TIMEOUT,
        "seconds for a request's headers to arrive; a slower client gets 408, an idle connection is closed",
    )
    ready_timeout: float = 900.0  # seconds to wait for the engine to load the model
    # A dead engine process (killed, out of memory) is started again this many times; in-flight
    # requests get 503, later ones are served once it is back. Past that, /health stays 503.
    engine_restarts: int = _flag(
        3,
        "times a dead engine process is started again (in-flight requests get 503); "
        "past that /health stays 503 so the pod's liveness probe restarts it",
    )
    ipc_dir: str | None = _flag(None, "directory for the engine's ipc sockets (default: temp)", flag="--engine-ipc-dir")
    engine_input_addr: str | None = _flag(None, "ZMQ endpoint for requests (instead of ipc)")
    engine_output_addr: str | None = _flag(None, "ZMQ endpoint for outputs (instead of ipc)")
    # The engine process's KV side (services/api/entry.py turns these into its EngineProcConfig).
    kv_events_endpoint: str | None = _flag(
        None, "bind a ZMQ PUB socket here for KV cache events, e.g. tcp://*:5557 (routers connect to it)"
    )
    kv_events_replay_endpoint: str | None = _flag(
        None, "bind a ZMQ ROUTER socket here that replays missed KV-event sequences, e.g. tcp://*:5558"
    )
    kv_connector: str = _flag(
        "none", "KV connector name, resolved by kvmesh.engine.connectors.make_connector (none: no connector)"
    )
    kv_connector_config: str = _flag("{}", "JSON options for the KV connector")  # JSON text, as given
    redis_url: str | None = _flag(None, "Redis for --kv-connector redis (same as config key `url`)")
    redis_password_file: str | None = _flag(
        None, "file holding the Redis AUTH password (default: $KVMESH_REDIS_PASSWORD)"
    )
    redis_tls: bool = _flag(False, "talk TLS to Redis (same as a rediss:// URL)", action="store_true")
    redis_tls_ca_file: str | None = _flag(
        None,
        "PEM bundle of the CA that signed Redis' certificate (implies --redis-tls; default: the system's CAs)",
    )
    kv_auth_key_file: str | None = _flag(
        None,
        "file holding the KV-path secret shared by the workers and the router (default: $KVMESH_KV_AUTH_KEY): "
        "it MACs the NIXL side channel (required with --kv-connector nixl) and the KV-event sockets then admit "
        "only the router (CURVE; without it: plain sockets, with a warning)",
    )
    stats_interval: float = _flag(0.5, "seconds between engine stats snapshots")
    uvicorn_log_level: str = _flag("warning", "uvicorn's log level", flag="--log-level")
    # On SIGTERM: stop accepting, let open requests and streams finish, then let the engine hand over
    # blocks held for remote readers; all within this many seconds (the pod's grace period covers it).
    shutdown_timeout: float = _flag(
        30.0,
        "on SIGTERM, seconds to finish open requests and hand over KV blocks held for "
        "remote readers before exiting (keep it below the pod's grace period)",
    )
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port out of range: {self.port}")
        if self.max_request_tokens < 0:
            raise ValueError("max_request_tokens must be >= 0")
        if self.max_body_bytes < 1024:
            raise ValueError("max_body_bytes must be >= 1024")
        if self.engine_restarts < 0:
            raise ValueError("engine_restarts must be >= 0")
        if self.body_timeout <= 0 or self.header_timeout <= 0:
            raise ValueError("body_timeout and header_timeout must be > 0")
        if self.shutdown_timeout < 0:
            raise ValueError("shutdown_timeout must be >= 0")
        if (self.engine_input_addr is None) != (self.engine_output_addr is None):
            raise ValueError("give both engine addresses or neither")
