"""Frozen configuration of one API server (one pod of any role)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvmesh.common.roles import Role
from kvmesh.services.http_server import DEFAULT_HEADER_TIMEOUT


@dataclass(frozen=True)
class ServerConfig:
    host: str = "0.0.0.0"
    port: int = 8000  # 0: the kernel picks one when uvicorn binds (nothing can take it first)
    # Written once uvicorn listens ({"url", "port", "pid"}; renamed into place, removed on exit): how
    # a parent learns the port of ``port`` 0 and that the server is up (`kvmesh up`).
    ready_file: str | None = None
    role: Role = "both"  # what the engine runs as (checked by the CLI and the engine); the API is the same
    served_model_names: tuple[str, ...] = ()  # empty: the engine's model name
    # Accepted API keys (services/auth.py): every endpoint but /health, /live and /metrics needs one
    # when any is set. Empty and no file: $KVMESH_API_KEY / $KVMESH_API_KEYS_FILE, else open.
    api_keys: tuple[str, ...] = ()
    api_keys_file: str | None = None  # JSON list of {key, tenant, priority, rpm, tpm}, re-read on change
    max_body_bytes: int = 8 << 20  # larger bodies get 413
    body_timeout: float = 30.0  # seconds for a request body to arrive in full; slower ones get 408
    header_timeout: float = DEFAULT_HEADER_TIMEOUT  # seconds for a request's headers (services/http_server.py)
    ready_timeout: float = 900.0  # seconds to wait for the engine to load the model
    # A dead engine process (killed, out of memory) is started again this many times; in-flight
    # requests get 503, later ones are served once it is back. Past that, /health stays 503.
    engine_restarts: int = 3
    ipc_dir: str | None = None  # where the engine's ipc sockets live (default: a fresh temp dir)
    engine_input_addr: str | None = None  # explicit ZMQ endpoints (e.g. tcp://127.0.0.1:5555) instead of ipc
    engine_output_addr: str | None = None
    uvicorn_log_level: str = "warning"
    # On SIGTERM: stop accepting, let open requests and streams finish, then let the engine hand over
    # blocks held for remote readers; all within this many seconds (the pod's grace period covers it).
    shutdown_timeout: float = 30.0
    # how `auto` tool calls are read from the output (services/api/tools.py PARSERS); None: from the chat template
    tool_call_parser: str | None = None
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port out of range: {self.port}")
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
