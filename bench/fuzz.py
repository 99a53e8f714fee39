"""`kvmesh bench fuzz`: schemathesis and hand-made malformed requests against a live server and router.

Starts a `kvmesh serve` (the embedded model on the CPU unless ``--serve-args`` say otherwise) and a
`kvmesh router` in front of it, or uses ``--base-url`` / ``--router-url``. Then:

1. schemathesis generates requests from each one's ``/openapi.json`` (valid and invalid ones), for
   every operation, ``--max-examples`` each; ``max_tokens`` and ``n`` are capped in generated bodies so
   a run takes minutes (the bounds themselves are probed in step 2);
2. raw probes: malformed and non-JSON bodies, invalid UTF-8, deep nesting, out-of-range integers,
   wrong types, many and huge headers, a 10 MB prompt, a body and headers that trickle in, a client that
   leaves.

Invariants reported (and the exit status is 1 if one fails): no 5xx other than a documented 503,
every error body in the OpenAI schema, no client timeout (hang), no server or engine process that
died or was restarted, and the pools empty afterwards (``vllm:num_requests_running`` 0, KV usage 0).
Prints a summary table and writes it as JSON.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field

from kvmesh.common.python_child import kvmesh_command
from kvmesh.services.http_server import DEFAULT_HEADER_TIMEOUT
from kvmesh.testing.servers import wait_pools_idle

CAP_MAX_TOKENS = 8
CAP_N = 4


@dataclass
class Tally:
    """What the run saw, per target (``server`` or ``router``)."""

    sent: int = 0
    statuses: collections.Counter = field(default_factory=collections.Counter)
    server_errors: list[str] = field(default_factory=list)  # 5xx other than 503: must stay empty
    bad_error_bodies: list[str] = field(default_factory=list)  # 4xx/5xx not in the OpenAI error schema
    hangs: list[str] = field(default_factory=list)  # client timeouts

    def record(self, what: str, status: int | None, body: bytes, ctype: str) -> None:
        self.sent += 1
        if status is None:
            self.hangs.append(what)
            self.statuses["timeout"] += 1
            return
        self.statuses[str(status)] += 1
        if status >= 500 and status != 503:
            self.server_errors.append(f"{status} {what}: {body[:200]!r}")
        if status >= 400 and not _openai_error(body, status, ctype):
            self.bad_error_bodies.append(f"{status} {what}: {body[:200]!r}")


def _openai_error(body: bytes, status: int, ctype: str) -> bool:
    if not ctype.startswith("application/json"):
        return False
    try:
        err = json.loads(body)["error"]
        return err["code"] == status and isinstance(err["message"], str) and "type" in err
    except (ValueError, KeyError, TypeError):
        return False


# ---- pools -----------------------------------------------------------------------------------------


# ---- schemathesis ----------------------------------------------------------------------------------
def _cap(body):
    """Keep a generated body cheap to serve: bounded max_tokens and n (bounds are probed separately).

    A missing or null max_tokens means the rest of the context (chat, or an explicit null), minutes of
    generation on a loaded CPU: it gets the cap too."""
    if isinstance(body, dict):
        limits = [body.get(k) for k in ("max_tokens", "max_completion_tokens")]
        if all(v is None for v in limits):  # a wrong type stays: the server must refuse it
            body.pop("max_completion_tokens", None)
            body["max_tokens"] = CAP_MAX_TOKENS
        for k in ("max_tokens", "max_completion_tokens"):
            if isinstance(body.get(k), int) and not isinstance(body.get(k), bool) and body[k] > CAP_MAX_TOKENS:
                body[k] = CAP_MAX_TOKENS
        if isinstance(body.get("n"), int) and not isinstance(body.get("n"), bool) and body["n"] > CAP_N:
            body["n"] = CAP_N
    return body


def run_schemathesis(url: str, tally: Tally, max_examples: int, seed: int, timeout: float) -> None:
    """Every operation of ``url``'s OpenAPI schema, valid and invalid requests, ``max_examples`` each."""
    import httpx
    import schemathesis

    spec = httpx.get(url + "/openapi.json", timeout=30).json()
    schema = schemathesis.openapi.from_dict(spec)
    with httpx.Client(base_url=url, timeout=timeout) as http:
        for res in schema.get_all_operations():
            op = res.ok()  # type: ignore[union-attr]  # an invalid operation raises here: the schema is ours
            for mode in (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE):
                before = tally.sent
                _fuzz_operation(http, url, op, mode, tally, max_examples, seed)
                print(f"  {url} {op.method.upper()} {op.path} {mode.name.lower()}: {tally.sent - before}", flush=True)


def _fuzz_operation(http, url: str, op, mode, tally: Tally, max_examples: int, seed: int) -> None:
    import httpx
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hseed
    from hypothesis.errors import Unsatisfiable

    @hseed(seed)
    @settings(
        max_examples=max_examples,
        database=None,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        phases=[Phase.generate],
    )
    @given(op.as_strategy(generation_mode=mode))
    def one(case) -> None:
        kw = case.as_transport_kwargs(base_url=url)
        if "json" in kw:
            kw["json"] = _cap(kw["json"])
        what = f"{mode.name.lower()} {case.method} {case.path}"
        try:
            r = http.request(
                kw["method"],
                kw["url"],
                headers=kw.get("headers"),
                params=kw.get("params"),
                json=kw.get("json"),
                content=kw.get("data") if "json" not in kw else None,
            )
        except httpx.TimeoutException:
            tally.record(what, None, b"", "")
            return
        except httpx.TransportError as e:  # the server dropped the connection: a failure, never a pass
            tally.sent += 1
            tally.statuses["connection error"] += 1
            tally.server_errors.append(f"connection error {what}: {e!r} body {str(kw.get('json'))[:200]}")
            return
        tally.record(what, r.status_code, r.content, r.headers.get("content-type", ""))

    try:
        one()
    except Unsatisfiable:
        pass  # no invalid request exists for an operation without parameters


# ---- raw probes ------------------------------------------------------------------------------------
def _raw(url: str, data: bytes, timeout: float, trickle_s: float = 0.0) -> tuple[int | None, bytes, str]:
    """Send raw bytes; with ``trickle_s``, then one byte a 0.2 s for that long. (status, body, content type)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=timeout) as s:
        got = b""
        try:
            s.sendall(data)
        except OSError:  # refused before the whole request was sent (a 413 on Content-Length): read the answer
            pass
        end = time.monotonic() + trickle_s
        s.settimeout(0.2 if trickle_s else timeout)
        deadline = time.monotonic() + timeout + trickle_s
        while time.monotonic() < deadline:
            try:
                if time.monotonic() < end:
                    s.sendall(b" ")
                chunk = s.recv(65536)
            except TimeoutError:
                if time.monotonic() >= end and not trickle_s:
                    break
                continue
            except OSError:
                return (RESET if not got else None), got, ""
            if not chunk:
                break
            got += chunk
            head, sep, body = got.partition(b"\r\n\r\n")
            if sep:
                hdrs = {
                    k.strip().lower(): v.strip()
                    for k, _, v in (ln.partition(":") for ln in head.decode().split("\r\n")[1:])
                }
                if len(body) >= int(hdrs.get("content-length", 0) or 0):
                    return int(head.split(b" ", 2)[1]), body, hdrs.get("content-type", "")
        return None, got, ""


RESET = -1  # the server reset the connection before an answer could be read (not a hang)


def _post(path: str, body: bytes, ctype: str = "application/json", extra: str = "") -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: fuzz\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
        f"{extra}Connection: close\r\n\r\n"
    ).encode() + body


def raw_probes() -> list[tuple[str, bytes, float]]:
    """(name, raw request, seconds to trickle for) for each hand-made probe."""
    ok = {"prompt": "Hello", "max_tokens": 2}
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    probes: list[tuple[str, bytes, float]] = []
    bodies = {
        "invalid JSON": b'{"prompt": ',
        "empty body": b"",
        "JSON array": b"[1,2,3]",
        "JSON null": b"null",
        "NaN": b'{"prompt": "a", "temperature": NaN}',
        "invalid UTF-8": b'{"prompt": "\xff\xfe\xfd"}',
        "nested 10,000 deep": b'{"prompt": "a", "x": ' + b"[" * 10_000 + b"]" * 10_000 + b"}",
        "nested 10,000 deep objects": b'{"prompt": "a", "x": ' + b'{"a":' * 10_000 + b"1" + b"}" * 10_000 + b"}",
        "10 MB prompt": json.dumps({"prompt": "word " * (2 << 20), "max_tokens": 2}).encode(),
    }
    wrong: dict[str, list] = {
        "seed": [2**70, -(2**70), 1.5, "1"],
        "max_tokens": ["10", -1, 0, 2**63, 1e30, True],
        "n": ["2", 1000, 0, 129],
        "stream": ["yes", 1],
        "temperature": ["hot", -1],
        "stop": [["a"] * 1000, "x" * 100_000, [1, 2]],
        "logprobs": [1000, "5"],
        "logit_bias": [{"x": 1}, {"1": 1e9}],
        "prompt": [[], [2**70], [[]], [-1], 5],
        "stop_token_ids": [list(range(1000))],
    }
    for field_, values in wrong.items():
        for v in values:
            bodies[f"{field_}={json.dumps(v)[:24]}"] = json.dumps({**ok, field_: v}).encode()
    for name, b in bodies.items():
        probes.append((f"completions {name}", _post("/v1/completions", b), 0.0))
    for name, b in {
        "messages empty": json.dumps({"messages": []}).encode(),
        "role missing": json.dumps({"messages": [{"content": "x"}]}).encode(),
        "content parts": json.dumps({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}).encode(),
        "n as a string": json.dumps({**chat, "n": "2"}).encode(),
        "top_logprobs 1000": json.dumps({**chat, "logprobs": True, "top_logprobs": 1000}).encode(),
    }.items():
        probes.append((f"chat {name}", _post("/v1/chat/completions", b), 0.0))
    okb = json.dumps(ok).encode()
    probes += [
        ("text/plain body", _post("/v1/completions", okb, "text/plain"), 0.0),
        ("form body", _post("/v1/completions", b"prompt=a", "application/x-www-form-urlencoded"), 0.0),
        ("2,000 headers", _post("/v1/completions", okb, extra="".join(f"X-H{i}: v\r\n" for i in range(2000))), 0.0),
        ("64 KB header", _post("/v1/completions", okb, extra=f"X-Big: {'v' * 65536}\r\n"), 0.0),
        ("bad Content-Length", okb.join([b"POST /v1/completions HTTP/1.1\r\nContent-Length: abc\r\n\r\n", b""]), 0.0),
        ("garbage request line", b"\x00\x01\x02 / HTTP/1.1\r\n\r\n", 0.0),
        ("unknown path", b"GET /nope HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", 0.0),
        ("wrong method", b"DELETE /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", 0.0),
    ]
    slow = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100000\r\n"
        b"Connection: close\r\n\r\n{"
    )
    probes.append(("slow body", slow, -1.0))  # trickles for longer than the server's body timeout
    # headers that never end (one more space of a header value every 0.2 s): the header deadline's 408
    probes.append(("slow headers", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: ", -2.0))
    return probes


PARSER_PROBES = ("garbage request line", "bad Content-Length")  # refused by the HTTP parser, not the app


def run_raw(url: str, tally: Tally, timeout: float, body_timeout: float, header_timeout: float) -> None:
    for name, data, trickle in raw_probes():
        if trickle < 0:  # -1: past the body timeout, -2: past the header timeout
            trickle = (body_timeout if trickle == -1 else header_timeout) + 5
        status, body, ctype = _raw(url, data, timeout, trickle)
        if name in PARSER_PROBES and (status is None or 400 <= status < 500):
            tally.sent += 1  # uvicorn's parser answers a plain-text 400 or closes: never reaches the app
            tally.statuses[f"{status or 'closed'} (parser)"] += 1
            continue
        if status == RESET:
            tally.sent += 1
            tally.statuses["reset"] += 1
            continue
        tally.record(f"raw {name}", status, body, ctype)
    # a client that leaves: a long non-streaming request, the connection closed mid-generation
    body = json.dumps({"prompt": "Tell a long story.", "max_tokens": 200, "ignore_eos": True}).encode()
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=timeout) as s:
        s.sendall(_post("/v1/completions", body))
        time.sleep(1.0)
    tally.sent += 1
    tally.statuses["client left"] += 1


# ---- processes -------------------------------------------------------------------------------------
def _start(args) -> tuple[list, str, str]:
    from kvmesh.health import wait_healthy
    from kvmesh.testing.servers import ServerProcess
    from kvmesh.topology import free_port

    server = ServerProcess(
        [
            *args.serve_args.split(),
            "--body-timeout",
            str(args.body_timeout),
            "--header-timeout",
            str(args.header_timeout),
        ],
        env={"KVMESH_LOG_LEVEL": "WARNING"},
        log_path=os.path.join(args.output_dir, "serve.log"),
    ).start()
    port = free_port()
    rlog = open(os.path.join(args.output_dir, "router.log"), "wb")
    router = subprocess.Popen(
        kvmesh_command(
            "router",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--worker",
            server.base_url,
            "--body-timeout",
            str(args.body_timeout),
            "--header-timeout",
            str(args.header_timeout),
        ),
        stdout=rlog,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    router_url = f"http://127.0.0.1:{port}"
    wait_healthy(router_url, 120, router, "router")
    return [server, router], server.base_url, router_url


def fuzz(
    server_url: str,
    router_url: str | None,
    max_examples: int,
    seed: int,
    timeout: float,
    body_timeout: float,
    engine_pid=None,
    header_timeout: float = DEFAULT_HEADER_TIMEOUT,
) -> dict:
    """Run everything against a live server (and router); the summary as a dict."""
    t0 = time.monotonic()
    targets = {"server": server_url, **({"router": router_url} if router_url else {})}
    pid0 = engine_pid() if engine_pid else None
    tallies = {}
    for name, url in targets.items():
        t = tallies[name] = Tally()
        print(f"{name} {url}: schemathesis", flush=True)
        run_schemathesis(url, t, max_examples, seed, timeout)
        print(f"{name} {url}: raw probes", flush=True)
        run_raw(url, t, timeout, body_timeout, header_timeout)
    pools = wait_pools_idle(server_url)
    pid1 = engine_pid() if engine_pid else None
    return {
        "targets": targets,
        "max_examples": max_examples,
        "seed": seed,
        "seconds": round(time.monotonic() - t0, 1),
        "per_target": {k: {**asdict(v), "statuses": dict(sorted(v.statuses.items()))} for k, v in tallies.items()},
        "requests": sum(t.sent for t in tallies.values()),
        "server_errors": sum(len(t.server_errors) for t in tallies.values()),
        "bad_error_bodies": sum(len(t.bad_error_bodies) for t in tallies.values()),
        "hangs": sum(len(t.hangs) for t in tallies.values()),
        "engine_restarted": pid0 is not None and pid0 != pid1,
        "pools_after": {
            "num_requests_running": pools["vllm:num_requests_running"],
            "num_requests_waiting": pools["vllm:num_requests_waiting"],
            "kv_cache_usage_perc": pools["vllm:kv_cache_usage_perc"],
        },
    }


def passed(s: dict) -> bool:
    p = s["pools_after"]
    return (
        s["server_errors"] == 0
        and s["bad_error_bodies"] == 0
        and s["hangs"] == 0
        and not s["engine_restarted"]
        and s.get("crashed", 0) == 0
        and p["num_requests_running"] == 0
        and p["kv_cache_usage_perc"] == 0.0
    )


def print_summary(s: dict) -> None:
    codes = sorted({c for t in s["per_target"].values() for c in t["statuses"]})
    print(f"fuzz: {s['requests']} requests in {s['seconds']} s (max_examples {s['max_examples']}, seed {s['seed']})")
    print(f"{'target':8} {'sent':>6} " + " ".join(f"{c:>7}" for c in codes))
    for name, t in s["per_target"].items():
        print(f"{name:8} {t['sent']:>6} " + " ".join(f"{t['statuses'].get(c, 0):>7}" for c in codes))
    p = s["pools_after"]
    print(
        f"5xx other than 503: {s['server_errors']}  non-OpenAI error bodies: {s['bad_error_bodies']}  "
        f"hangs: {s['hangs']}  crashed: {s.get('crashed', 0)}  engine restarted: {s['engine_restarted']}  "
        f"after: running {p['num_requests_running']:g}, waiting {p['num_requests_waiting']:g}, "
        f"kv usage {p['kv_cache_usage_perc']:g}"
    )
    for t in s["per_target"].values():
        for line in (t["server_errors"] + t["bad_error_bodies"] + t["hangs"])[:10]:
            print("  ", line)
    print("PASS" if passed(s) else "FAIL")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default=None, help="a running API server (default: start `kvmesh serve`)")
    p.add_argument("--router-url", default=None, help="a running router in front of it (default: start one)")
    p.add_argument(
        "--serve-args",
        default="--max-model-len 512 --num-kv-blocks 512 --stats-interval 0.1",
        help="flags of the `kvmesh serve` started (without --base-url)",
    )
    p.add_argument("--max-examples", type=int, default=100, help="generated requests per operation and mode")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--request-timeout", type=float, default=60.0, help="a client timeout counts as a hang")
    p.add_argument("--body-timeout", type=float, default=5.0, help="the servers' --body-timeout (slow-body probe)")
    p.add_argument(
        "--header-timeout", type=float, default=5.0, help="the servers' --header-timeout (slow-headers probe)"
    )
    p.add_argument("--output-dir", default="bench-results/fuzz")
    p.add_argument("--output", default=None, help="summary JSON (default: OUTPUT_DIR/fuzz.json)")


def run(args: argparse.Namespace) -> int:
    from kvmesh.testing.servers import ServerProcess, alive

    signal.signal(signal.SIGTERM, signal.default_int_handler)  # a SIGTERM stops what we started too
    os.makedirs(args.output_dir, exist_ok=True)
    procs: list = []
    try:
        if args.base_url:
            server_url, router_url, engine_pid = args.base_url, args.router_url, None
        else:
            procs, server_url, router_url = _start(args)
            engine_pid = procs[0].engine_pid
        s = fuzz(
            server_url,
            router_url,
            args.max_examples,
            args.seed,
            args.request_timeout,
            args.body_timeout,
            engine_pid,
            args.header_timeout,
        )
        crashed = 0
        for p in procs:
            proc = p.proc if isinstance(p, ServerProcess) else p
            assert proc is not None
            crashed += 0 if proc.poll() is None and alive(proc.pid) else 1
        s["crashed"] = crashed
        s["command"] = " ".join(["kvmesh", "bench", "fuzz", *sys.argv[3:]])
        s["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    finally:
        for p in procs:
            if isinstance(p, ServerProcess):
                p.stop()
            else:
                p.terminate()
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
    out = args.output or os.path.join(args.output_dir, "fuzz.json")
    with open(out, "w") as f:
        json.dump(s, f, indent=2)
    print_summary(s)
    print(f"summary: {out}")
    return 0 if passed(s) else 1
