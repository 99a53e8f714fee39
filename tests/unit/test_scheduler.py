"""The scheduler without a model: its output is plain data, and it owns what a step's tokens do."""

from __future__ import annotations

import dataclasses

import pytest

from kvmesh.engine.config import SchedulerConfig
from kvmesh.engine.core.kv_cache_manager import KVCacheManager
from kvmesh.engine.core.request import Request
from kvmesh.engine.core.sched_output import ScheduledRequest
from kvmesh.engine.core.scheduler import Scheduler
from kvmesh.engine.frontend.sampling_params import SamplingParams
from kvmesh.engine.runner.sampler import SampleResult

pytestmark = pytest.mark.unit
BS = 4
EOS = 2


def make(num_blocks: int = 32, **cfg) -> Scheduler:
    return Scheduler(SchedulerConfig(**cfg), KVCacheManager(num_blocks, BS), eos_token_ids=[EOS])


def add(s: Scheduler, rid: str, prompt: list[int], **params) -> Request:
    r = Request(rid, list(prompt), SamplingParams(**params), BS, "test-model")
    s.add_request(r)
    return r


def step(s: Scheduler, tokens: dict[str, list[int]]):
    """One step whose sampling rows draw ``tokens[request id]`` (one per sample)."""
    out = s.schedule()
    rows = [j for j, e in enumerate(out.scheduled) if e.completes_prompt]
    samples = [SampleResult(t) for j in rows for t in tokens[out.scheduled[j].request_id]]
    outputs = s.update_from_output(out, rows, samples)
    s.check_integrity()
    return out, outputs


def test_output_holds_no_request():
    s = make()
    r = add(s, "a", [5, 6, 7, 8, 9])
    out = s.schedule()
    (e,) = out.scheduled
    assert isinstance(e, ScheduledRequest)
    for f in dataclasses.fields(e):
        assert not isinstance(getattr(e, f.name), Request), f.name
    assert (e.request_id, e.num_computed_tokens, e.num_tokens, e.num_samples) == ("a", 0, 5, 1)
    assert e.all_token_ids is r.all_token_ids  # by reference: no per-token copy
    assert e.block_ids == s.kv.get_block_ids("a") and e.completes_prompt


def test_stops_are_the_schedulers():
    s = make()
    add(s, "len", [5, 6, 7], max_tokens=2)
    add(s, "eos", [5, 6, 7], max_tokens=10)
    add(s, "stop", [5, 6, 7], max_tokens=10, stop_token_ids=(11,))
    _, outs = step(s, {"len": [9], "eos": [EOS], "stop": [11]})
    done = {o.request_id: (o.finish_reason, o.stop_reason) for o in outs if o.finished}
    assert done == {"eos": ("stop", None), "stop": ("stop", 11)}
    _, outs = step(s, {"len": [9]})
    assert [(o.request_id, o.finish_reason) for o in outs] == [("len", "length")]
    assert not s.requests and not s.groups and s.kv.pool.num_free_blocks == s.kv.pool.num_blocks


def test_n_completions_fork_inside_the_scheduler():
    s = make()
    add(s, "p", [5, 6, 7, 8, 9], n=3, max_tokens=2, temperature=1.0)
    out, outs = step(s, {"p": [20, 21, 22]})
    assert out.scheduled[0].num_samples == 3
    assert sorted((o.index, o.new_token_ids[0]) for o in outs) == [(0, 20), (1, 21), (2, 22)]
    assert s.groups == {"p": ["p", "p#1", "p#2"]} and len(s.running) == 3
    out, outs = step(s, {"p": [30], "p#1": [31], "p#2": [32]})
    assert [e.num_samples for e in out.scheduled] == [1, 1, 1]
    assert all(o.finish_reason == "length" for o in outs) and not s.groups


def test_failed_step_finishes_with_an_error():
    s = make()
    add(s, "a", [5, 6, 7])
    s.schedule()
    o = s.fail("a", "boom")
    assert (o.finish_reason, o.error) == ("error", "boom") and s.fail("a", "again") is None
    assert not s.requests and not s.running
    s.check_integrity()


def test_round_questions_read_only():
    s = make(max_num_seqs=2)
    add(s, "a", [5, 6, 7], max_tokens=5)
    step(s, {"a": [9]})
    assert s.extends_output("a") and s.runs_exactly(["a"]) and not s.could_admit()
    assert s.decode_headroom(["a"], 0, 8) == 4 and s.decode_headroom(["a"], 4, 8) == 0
    add(s, "b", [5, 6, 7])
    assert s.could_admit() and not s.runs_exactly(["b"])
    held = len(s.kv.get_block_ids("a"))
    assert s.reserve_decode_slots(["a"], 0, 4) and len(s.kv.get_block_ids("a")) >= held
    s.check_integrity()


def test_integrity_sees_a_lost_request():
    s = make()
    r = add(s, "a", [5, 6, 7])
    s.waiting.remove(r)
    with pytest.raises(AssertionError):
        s.check_integrity()


def test_prompt_tokens_pending_is_the_uncomputed_prefill_backlog():
    s = make(max_num_batched_tokens=8, max_num_seqs=4)
    add(s, "a", list(range(10, 22)))  # 12 prompt tokens
    add(s, "b", list(range(30, 36)))  # 6
    assert s.num_prompt_tokens_pending() == 18
    step(s, {})  # 8 tokens of "a" (chunked prefill), "b" waits
    assert s.num_prompt_tokens_pending() == 10
    step(s, {"a": [5]})  # the rest of "a" (4) and 4 of "b"
    assert s.num_prompt_tokens_pending() == 2
    step(s, {"a": [5], "b": [5]})
    assert s.num_prompt_tokens_pending() == 0
