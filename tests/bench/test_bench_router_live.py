"""`kvmesh bench router` end to end on a tiny trace: real simulated instances, kvmesh's router, a
variant of it and round-robin, two rounds with the instances' caches reset between runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kvmesh.common.python_child import kvmesh_command

pytestmark = pytest.mark.integration


def bench_router(tmp_path, rows: list[dict], policies: str, rate: str, *flags: str) -> list[str]:
    """`kvmesh bench router` over ``rows`` (written as the trace) on two small simulated instances."""
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return kvmesh_command(
        "bench",
        "router",
        "--trace",
        str(trace),
        "--instances",
        "2",
        "--policies",
        policies,
        "--requests",
        "0",
        "--rate",
        rate,
        "--max-output",
        "2",
        "--max-model-len",
        "512",
        "--num-kv-blocks",
        "64",
        "--log-dir",
        str(tmp_path / "logs"),
        *flags,
    )


def test_bench_router_repeats_with_cold_caches(tmp_path):
    # two conversations of three turns; every turn extends the previous one by a block
    rows = []
    for c in range(2):
        for turn in range(3):
            rows.append(
                {
                    "timestamp": 100 * (2 * turn + c),
                    "input_length": 512 * (turn + 3),
                    "output_length": 2,
                    "hash_ids": [0] + [100 * (c + 1) + k for k in range(turn + 2)],
                }
            )
    out = tmp_path / "router.json"
    env = dict(os.environ, KVMESH_CPU_THREADS="1")
    p = subprocess.run(
        bench_router(
            tmp_path,
            rows,
            "round-robin,kvmesh,noshare",
            "4",
            *("--variant", "noshare=--weight-share 0", "--repeats", "2", "--json", str(out)),
        ),
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["_setup"]["repeats"] == 2
    # turns 2 and 3 reuse their previous turn's blocks; the second conversation's first turn, block 0
    ideal = (16 + 48 * 2 + 64 * 2) / ((48 + 64 + 80) * 2)
    for pol in ("round-robin", "kvmesh", "noshare"):
        r = res[pol]
        assert [x["round"] for x in r["runs"]] == [0, 1] and r["ok"] == 12 and r["failed"] == 0
        assert r["ideal_hit_ratio"] == pytest.approx(ideal)
        # every run starts cold: a second run of the same prompts is no warmer than the first
        assert all(x["hit_ratio"] <= ideal + 1e-9 for x in r["runs"])
        # per request, in trace order: prompt length, ideal and actual cached tokens, TTFT
        for x in r["runs"]:
            assert x["prompt_tokens"] == [48, 48, 64, 64, 80, 80]
            assert len(x["ttft"]) == len(x["cached"]) == 6 and all(t > 0 for t in x["ttft"])
            assert all(c <= h for c, h in zip(x["cached"], x["ideal_cached"]))
    # kvmesh keeps each conversation on the pod holding it, in both runs (only the shared first block
    # may be lost, when the two conversations start on different pods)
    for pol in ("kvmesh", "noshare"):
        assert all(x["hit_ratio"] >= ideal - 16 / 384 - 1e-9 for x in res[pol]["runs"])
    assert "per run" in p.stdout and "round 2" in p.stdout


def test_bench_router_runs_a_policy_with_and_without_the_host_tier(tmp_path):
    """``--kv-offload-blocks`` starts a second instance set with a host tier; ``kvmesh+tier`` replays the
    same requests there. One instance a set, a 16-block pool: a conversation's blocks are evicted by a
    long filler before its second turn, so only the tiered instance serves that turn from cache."""
    rows = [
        {"timestamp": 0, "input_length": 512 * 4, "output_length": 2, "hash_ids": [1, 2, 3, 4]},
        {"timestamp": 1000, "input_length": 512 * 15, "output_length": 2, "hash_ids": list(range(100, 115))},
        {"timestamp": 2000, "input_length": 512 * 5, "output_length": 2, "hash_ids": [1, 2, 3, 4, 5]},
    ]
    out = tmp_path / "router.json"
    env = dict(os.environ, KVMESH_CPU_THREADS="1")
    flags = ("--instances", "1", "--num-kv-blocks", "16", "--kv-offload-blocks", "64", "--json", str(out))
    p = subprocess.run(
        bench_router(tmp_path, rows, "kvmesh,kvmesh+tier", "2", *flags),
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["_setup"]["kv_offload_blocks_per_instance"] == 64
    plain, tier = res["kvmesh"], res["kvmesh+tier"]
    assert plain["ok"] == tier["ok"] == 3 and plain["prompt_tokens"] == tier["prompt_tokens"]
    assert plain["cached"][2] == 0  # the filler evicted the conversation: recomputed
    assert tier["cached"][2] == 4 * 16  # its four blocks, loaded back from the host tier
    t = res["_tier"]["kvmesh"]
    assert t["hit_ratio_tier"] > t["hit_ratio"] and t["ttft_p90_speedup"] is not None
    assert "with the host tier" in p.stdout


def test_sigterm_stops_the_instances(tmp_path):
    """The instances run in sessions of their own (so a stop can take their engine children too); a
    SIGTERM to the bench must still stop them all, not leave them running without a parent."""
    import signal
    import time

    from kvmesh.testing.servers import alive, descendants

    rows = [{"timestamp": 1000 * i, "input_length": 512, "output_length": 2, "hash_ids": [i]} for i in range(4)]
    env = dict(os.environ, KVMESH_CPU_THREADS="1")
    p = subprocess.Popen(
        bench_router(tmp_path, rows, "round-robin", "0.5"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
    )
    try:
        tree: set[int] = set()
        for _ in range(240):  # both instances with their engine processes (4), then the router (5)
            tree |= descendants(p.pid)
            if len(tree) >= 5 or p.poll() is not None:
                break
            time.sleep(0.5)
        assert len(tree) >= 5 and p.poll() is None, tree
        p.send_signal(signal.SIGTERM)
        assert p.wait(60) != 0
        for _ in range(60):
            left = [t for t in tree if alive(t)]
            if not left:
                break
            time.sleep(0.5)
        assert not left, left
    finally:
        if p.poll() is None:
            p.kill()


def test_stray_children_are_stopped_with_their_groups(tmp_path):
    """`stop_strays` (the bench's last step on the way out) stops a child that no `Proc` holds, as a
    SIGTERM between a fork and its `Proc` leaves one: its whole session, grandchild included."""
    from kvmesh.testing.servers import alive

    script = tmp_path / "bench_like.py"
    script.write_text(
        "import subprocess, sys, time\n"
        "from kvmesh.bench.router import stop_strays\n"
        "child = [sys.executable, '-c', 'import subprocess, sys, time; '\n"
        '         \'g = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"]); \'\n'
        "         'print(g.pid, flush=True); time.sleep(120)']\n"
        "p = subprocess.Popen(child, start_new_session=True, stdout=subprocess.PIPE, text=True)\n"
        "grandchild = int(p.stdout.readline())\n"
        "print(p.pid, grandchild, flush=True)\n"
        "del p  # nothing holds it any more, as after an interrupted start\n"
        "stop_strays(grace_s=5)\n"
        "print('done', flush=True)\n"
    )
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.split("\n")
    pids = [int(x) for x in lines[0].split()]
    assert lines[1] == "done" and len(pids) == 2
    assert not [pid for pid in pids if alive(pid)]
