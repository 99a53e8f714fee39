"""The host-memory KV tier (``--kv-offload-gb``) on the embedded SmolLM2: a prefix evicted from a small
device pool is served from the host tier (loaded back, counted as cached, never recomputed) with the
greedy tokens of a run without the tier; under host pressure the oldest blocks go and the prefix is
recomputed; salts and adapters never cross tiers; tensor parallelism gives one rank's tokens."""

from __future__ import annotations

import random
import time

import pytest

from kvmesh import LLM, SamplingParams

pytestmark = pytest.mark.integration

BS = 16
BLOCKS = 12  # the device pool: one long prompt evicts another's blocks
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
_rng = random.Random(37)
A = [_rng.randrange(100, 20000) for _ in range(100)]  # 6 full blocks (the last token is never a hit)
B = [_rng.randrange(100, 20000) for _ in range(180)]  # the whole pool with its output: evicts all of A's
C = [_rng.randrange(100, 20000) for _ in range(180)]


def _block_bytes(llm: LLM) -> int:
    kv = llm.engine.runner.kv_cache
    return kv[0].numel() * kv.element_size()


def _serve(llm: LLM, prompts, salts=None, loras=None):
    """Each prompt alone, in order: (tokens, num_cached_tokens) per prompt; integrity after each."""
    out = []
    for i, p in enumerate(prompts):
        salt = salts[i] if salts else None
        lora = loras[i] if loras else None
        o = llm.generate([p], GREEDY, cache_salt=salt, lora_name=lora)[0]
        llm.engine.scheduler.check_integrity()
        out.append((o.outputs[0].token_ids, o.num_cached_tokens))
    return out


def _hashes(llm: LLM, prompt, lora: str) -> list:
    """The block hashes the engine gives ``prompt``'s first six blocks under adapter ``lora``."""
    from kvmesh.engine.core.request import Request

    e = llm.engine
    assert e.lora is not None
    r = Request("probe", list(prompt), GREEDY, BS, e.model_identity, lora=e.lora.id_of(lora))
    return r.block_hashes[:6]


@pytest.fixture(scope="module")
def baseline(smol):
    llm = LLM(loaded=smol, num_kv_blocks=BLOCKS, block_size=BS)
    return _serve(llm, [A, B, A, C, A]), _block_bytes(llm)


def test_an_evicted_prefix_comes_back_from_the_host(smol, baseline):
    want, _ = baseline
    assert want[2][1] == 0  # without the tier A was evicted: recomputed
    llm = LLM(loaded=smol, num_kv_blocks=BLOCKS, block_size=BS, kv_offload_gb=0.05)
    got = _serve(llm, [A, B, A, C, A])
    assert [t for t, _ in got] == [t for t, _ in want]
    assert got[2][1] == 6 * BS and got[4][1] == 6 * BS  # all of A's full blocks, loaded back
    s = llm.engine.stats()
    assert s.kv_offload_loaded >= 12 and s.kv_offload_hit_tokens >= 12 * BS
    assert s.kv_offload_stored > 0 and s.kv_offload_evictions == 0
    assert s.kv_offload_blocks["CPU"] == llm.engine.kv.pool.host.num_cached > 0
    # the loaded blocks were not recomputed: the model ran only what neither tier had
    computed = sum(len(p) for p in (A, B, A, C, A)) + 5 * (GREEDY.max_tokens - 1) - 2 * 6 * BS
    assert s.num_computed_tokens == computed


def test_under_host_pressure_the_oldest_blocks_go_and_the_prefix_is_recomputed(smol, baseline):
    want, per_block = baseline
    gb = 4.5 * per_block / (1 << 30)  # four slots
    llm = LLM(loaded=smol, num_kv_blocks=BLOCKS, block_size=BS, kv_offload_gb=gb)
    host = llm.engine.kv.pool.host
    assert host is not None and host.num_slots == 4
    got = _serve(llm, [A, B, A, C, A])
    assert [t for t, _ in got] == [t for t, _ in want]
    # A's blocks left the device last block first (freed tail first): the host kept its first four
    assert got[2][1] == 4 * BS
    s = llm.engine.stats()
    assert s.kv_offload_evictions > 0
    assert got[4][1] < 6 * BS  # C pushed part of A out of both tiers: recomputed, same tokens


def test_salts_never_cross_the_host_tier(smol):
    llm = LLM(loaded=smol, num_kv_blocks=BLOCKS, block_size=BS, kv_offload_gb=0.05)
    got = _serve(llm, [A, B, A, A], salts=["t1", None, "t2", "t1"])
    assert got[2][1] == 0  # another tenant: neither tier serves t1's blocks
    assert got[3][1] == 6 * BS  # t1 again: from the host tier
    assert llm.engine.stats().kv_offload_loaded == 6
    assert got[2][0] == got[3][0] == got[0][0]


def test_adapters_never_cross_the_host_tier(smol, hf_model, tmp_path):
    from lora_checks import make_adapter

    path = str(tmp_path / "qv8")
    make_adapter(hf_model, path, 8, 16, ["q_proj", "v_proj"], False, 1.0, 0)
    llm = LLM(loaded=smol, num_kv_blocks=BLOCKS, block_size=BS, kv_offload_gb=0.05, lora_modules=(f"qv8={path}",))
    got = _serve(llm, [A, B, A], loras=["qv8", None, None])
    assert llm.engine.kv.pool.host is not None
    assert set(llm.engine.kv.pool.host.cached) >= set(_hashes(llm, A, "qv8"))  # the adapter's blocks, on the host
    assert got[2][1] == 0 and llm.engine.stats().kv_offload_loaded == 0  # the base model never reads them
    got += _serve(llm, [A, A], loras=["qv8", None])
    assert got[3][1] == 6 * BS  # the adapter's own, from the host tier
    assert got[4][1] == 6 * BS  # the base model's own (computed by got[2]), from either tier
    assert llm.engine.stats().kv_offload_loaded >= 6
    assert got[0][0] == got[3][0] and got[2][0] == got[4][0]


def test_tensor_parallel_host_tier_gives_one_ranks_tokens(smol, baseline):
    """Three ranks on the CPU (gloo), each keeping its own heads' host copy: one rank's tokens, and
    the prefix served from the host tier."""
    want, _ = baseline
    llm = LLM(
        loaded=smol, tensor_parallel_size=3, device="cpu", num_kv_blocks=BLOCKS, block_size=BS, kv_offload_gb=0.05
    )
    try:
        got = _serve(llm, [A, B, A, C, A])
        s = llm.engine.stats()
    finally:
        llm.engine.shutdown()
    assert [t for t, _ in got] == [t for t, _ in want]
    assert got[2][1] == 6 * BS and s.kv_offload_loaded >= 6


def test_every_tier_move_is_an_event_and_the_routers_view_equals_the_pod(smol, tmp_path):
    """The pod's events over ZMQ into the router's index: after a workload that offloads, drops host
    blocks (LRU) and loads back, the index's per-tier residency is exactly the pod's (drift zero)."""
    from kvmesh.common.hashing import external_hash
    from kvmesh.common.kv_events import MEDIUM_CPU, BlockRemoved, BlockStored
    from kvmesh.engine.core.kv_publisher import KVEventPublisher, PublisherConfig
    from kvmesh.services.router.events import EventHub
    from kvmesh.services.router.index import PrefixIndex
    from kvmesh.testing.pods import wait_for

    llm = LLM(loaded=smol, num_kv_blocks=BLOCKS, block_size=BS)
    per_block = _block_bytes(llm)
    llm = LLM(loaded=smol, num_kv_blocks=BLOCKS, block_size=BS, kv_offload_gb=8.5 * per_block / (1 << 30))
    engine = llm.engine
    engine.set_kv_events(True)
    idx = PrefixIndex()
    hub = EventHub(idx)
    ep = f"ipc://{tmp_path}/ev"
    pub = KVEventPublisher(PublisherConfig(ep, None, "kv@a@m"))
    hub.add_pod("a", "m", ep, None)
    time.sleep(0.5)
    kinds: dict[tuple[str, str | None], int] = {}
    try:
        for p in (A, B, A, C, A, B):
            llm.generate([p], GREEDY)
            events = engine.take_kv_events()
            for ev in events:
                if isinstance(ev, (BlockStored, BlockRemoved)):
                    key = (type(ev).__name__, ev.medium)
                    kinds[key] = kinds.get(key, 0) + len(ev.block_hashes)
            pub.publish(events)
        pool = engine.kv.pool
        assert pool.host is not None
        want = {
            "GPU": {external_hash(h) for h in pool.cached},
            "CPU": {external_hash(h) for h in pool.host.cached},
        }
        assert want["CPU"] and want["GPU"]
        assert wait_for(lambda: idx.pod_tiers("a", "m") == want, timeout=10)
    finally:
        pub.close()
        hub.close()
    s = engine.stats()
    # every move was published: offloads as CPU stores, LRU drops as CPU removals, loads as GPU stores
    assert kinds[("BlockStored", MEDIUM_CPU)] == s.kv_offload_stored
    assert kinds[("BlockRemoved", MEDIUM_CPU)] == s.kv_offload_evictions > 0
    assert s.kv_offload_loaded > 0 and kinds[("BlockStored", "GPU")] > 0


def test_decode_rounds_offload_what_their_reservations_evict(smol, baseline):
    """Multi-step decode rounds reserve blocks ahead (engine/core/decode_rounds.py): blocks those
    reservations evict are offloaded before the round writes them; same tokens."""
    want, _ = baseline
    llm = LLM(loaded=smol, num_kv_blocks=BLOCKS, block_size=BS, kv_offload_gb=0.05, num_scheduler_steps=4)
    got = _serve(llm, [A, B, A, C, A])
    assert [t for t, _ in got] == [t for t, _ in want]
    assert got[2][1] == 6 * BS and llm.engine.rounds.num_rounds > 0
