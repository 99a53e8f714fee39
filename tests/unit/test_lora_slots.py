"""LoRA slots without a model: LRU eviction of adapters with no running request, removal deferred
while requests use an adapter, the scheduler's bound on distinct adapters, and the flags."""

from __future__ import annotations

import argparse

import numpy as np
import pytest
import torch
from test_lora_adapters import CFG, _weights, write

from kvmesh.common.hashing import LoraId
from kvmesh.engine.args import EngineArgs
from kvmesh.engine.config import LoraConfig, SchedulerConfig
from kvmesh.engine.core.kv_cache_manager import KVCacheManager
from kvmesh.engine.core.request import Request
from kvmesh.engine.core.sched_output import ScheduledRequest, SchedulerOutput
from kvmesh.engine.core.scheduler import Scheduler
from kvmesh.engine.frontend.sampling_params import SamplingParams
from kvmesh.engine.lora import LoraError, LoraManager
from kvmesh.engine.runner.graphs import GraphLayout
from kvmesh.engine.runner.inputs import EagerStager, Staging, plan_step

pytestmark = pytest.mark.unit


class Runner:
    """Records what the manager asks of the runner."""

    def __init__(self) -> None:
        self.held: dict[str, object] = {}
        self.slots: dict[int, str] = {}

    def register(self, adapter) -> None:
        self.held[adapter.key] = adapter

    def load(self, slot: int, key: str) -> None:
        assert key in self.held
        self.slots[slot] = key

    def drop(self, key: str) -> None:
        del self.held[key]


@pytest.fixture
def lm(tmp_path):
    run = Runner()
    m = LoraManager(LoraConfig(enabled=True, max_loras=2), CFG, torch.float32, run.register, run.load, run.drop)
    for i, name in enumerate("abc"):
        m.add(name, write(tmp_path / name, weights=_weights(4, seed=i)))
    m.run = run  # type: ignore[attr-defined]
    return m


def test_least_recently_used_idle_slot_is_evicted(lm):
    a, b, c = (lm.key_of(n) for n in "abc")
    assert lm.slots_for([a, b, a], {a, b}) == {a: 0, b: 1}
    assert (lm.num_loads, lm.num_evictions) == (2, 0)
    lm.slots_for([b], {b})  # a idle and least recently used now
    assert lm.slots_for([c], {b, c}) == {c: 0} and lm.num_evictions == 1
    assert lm.run.slots == {0: c, 1: b}
    with pytest.raises(RuntimeError, match="in use"):
        lm.slots_for([a], {b, c, a})  # the scheduler never lets this happen
    assert lm.slots_for([a], {a, c}) == {a: 1}  # b idle: evicted
    assert sorted(lm.resident()) == ["a", "c"]


def test_removal_waits_for_the_requests_under_the_adapter(lm, tmp_path):
    a = lm.key_of("a")
    lm.slots_for([a], {a})
    assert lm.remove("a", keys_in_use=[a]) is True
    assert lm.remove("a", keys_in_use=[a]) is False
    with pytest.raises(LoraError, match="unknown LoRA adapter 'a'"):
        lm.key_of("a")
    assert a in lm.run.held and lm.names() == ["b", "c"]
    lm.slots_for([a], {a})  # still served to the requests that had it
    lm.retire([])
    assert a not in lm.run.held and a not in lm.slot_key and not lm.retiring
    with pytest.raises(LoraError, match="already loaded"):
        lm.add("b", write(tmp_path / "again"))


def _req(rid: str, lora: str | None) -> Request:
    return Request(
        rid, [5, 6, 7], SamplingParams(max_tokens=4), 4, "m", lora=lora and LoraId(lora, "/" + lora, lora + "@k")
    )


def test_the_scheduler_runs_at_most_max_loras_adapters_and_never_starves_the_base():
    s = Scheduler(SchedulerConfig(), KVCacheManager(64, 4), max_loras=2)
    for rid, lora in [("a", "A"), ("b", "B"), ("c", "C"), ("base", None), ("a2", "A"), ("d", "D")]:
        s.add_request(_req(rid, lora))
    out = s.schedule()
    assert [e.request_id for e in out.scheduled] == ["a", "b", "base", "a2"]
    assert [e.lora_key for e in out.scheduled] == ["A@k", "B@k", None, "A@k"]
    assert [r.request_id for r in s.waiting] == ["c", "d"]  # in order: c gets the next free slot
    s.check_integrity()
    s.finish(s.requests["b"], s.requests["b"].status.FINISHED_STOPPED)
    assert [e.request_id for e in s.schedule().scheduled] == ["a", "base", "a2", "c"]
    assert [r.request_id for r in s.waiting] == ["d"]
    s.check_integrity()


def test_lora_flags():
    args = EngineArgs(lora_modules=("x=/some/where", "y = /else"), max_loras=3)
    cfg = args.create_engine_config(CFG, "m")
    assert cfg.lora == LoraConfig(True, 3, 16, (("x", "/some/where"), ("y", "/else")))
    assert EngineArgs().create_engine_config(CFG, "m").lora.enabled is False
    assert EngineArgs(enable_lora=True).create_engine_config(CFG, "m").lora.enabled
    with pytest.raises(ValueError, match="NAME=PATH"):
        EngineArgs(lora_modules=("nopath",)).create_engine_config(CFG, "m")
    with pytest.raises(ValueError, match="unique"):
        EngineArgs(lora_modules=("x=/a", "x=/b")).create_engine_config(CFG, "m")
    with pytest.raises(ValueError, match="max_loras"):
        LoraConfig(enabled=True, max_loras=0)
    p = argparse.ArgumentParser()
    EngineArgs.add_cli_args(p)
    ns = p.parse_args(["--lora-modules", "a=/p", "--lora-modules", "b=/q", "--max-lora-rank", "64"])
    got = EngineArgs.from_cli_args(ns)
    assert (got.lora_modules, got.max_lora_rank, got.enable_lora) == (("a=/p", "b=/q"), 64, False)
    assert got.create_engine_config(CFG, "m").lora.enabled


def test_without_lora_a_step_stages_what_it_did_before():
    """LoRA off: no slots in the plan, in the eager inputs or in the graphs' buffer layout. LoRA on: each
    token its row's slot, and a step without adapter rows skips the LoRA work (no slots staged)."""
    rows = [
        ScheduledRequest("a", [1, 2, 3], 0, 3, SamplingParams(), block_ids=[0], lora_key="A@k", lora_slot=1),
        ScheduledRequest("b", [4, 5], 0, 2, SamplingParams(), block_ids=[1]),
    ]
    sched = SchedulerOutput(scheduled=rows)
    stager = EagerStager(Staging(256, torch.device("cpu")))
    off = plan_step(sched, 4)
    assert off.lora is None and stager.stage(off)[1].lora_slots is None
    on = plan_step(sched, 4, lora=True)
    assert on.lora.tolist() == [1, 1, 1, -1, -1]
    assert stager.stage(on)[1].lora_slots.tolist() == [1, 1, 1, -1, -1]
    rows[0].lora_slot = -1
    assert stager.stage(plan_step(sched, 4, lora=True))[1].lora_slots is None
    old = np.cumsum([0, 8, 8, 8, 9, 8, 8 * 5]).tolist()  # the layout before LoRA existed
    assert list(GraphLayout.for_rows(8, 5)) == old[:5] + [old[5]] + old[5:]
    with_lora = GraphLayout.for_rows(8, 5, lora=True)
    assert with_lora.block_tables - with_lora.lora == 8 and with_lora.end == old[-1] + 8
