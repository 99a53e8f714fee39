"""Structured outputs in the engine (offline `LLM`, the real model): constrained rows obey their
grammar, and the free rows of the same batch get exactly the tokens they get alone."""

from __future__ import annotations

import json
import re

import pytest

from kvmesh import SamplingParams
from kvmesh.engine.core.messages import EngineCoreRequest
from kvmesh.engine.frontend.structured import StructuredOutput

pytestmark = pytest.mark.integration

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "pet": {"enum": ["cat", "dog"]},
    },
    "required": ["name", "age", "pet"],
    "additionalProperties": False,
}
FREE_PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):"]
FREE = [
    SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
    SamplingParams(temperature=0.9, top_p=0.9, seed=5, max_tokens=16, ignore_eos=True),
    SamplingParams(temperature=0.7, top_k=20, seed=9, max_tokens=16, repetition_penalty=1.2, ignore_eos=True),
]


def _constrained() -> list[tuple[str, SamplingParams]]:
    js = StructuredOutput.json_schema(PERSON)
    return [
        ("A person as JSON:", SamplingParams(temperature=0.0, max_tokens=64, structured=js)),
        (
            "A person as JSON:",
            SamplingParams(temperature=0.8, min_p=0.05, presence_penalty=0.5, seed=1, max_tokens=64, structured=js),
        ),
        (
            "Phone:",
            SamplingParams(
                temperature=0.5, seed=2, max_tokens=16, structured=StructuredOutput("regex", r"\d{3}-\d{4}")
            ),
        ),
        (
            "Yes or no?",
            SamplingParams(temperature=0.0, max_tokens=8, structured=StructuredOutput.choice(["yes", "no"])),
        ),
    ]


def _check_constrained(outs) -> None:
    for o in outs[:2]:
        assert o.outputs[0].finish_reason == "stop", o.outputs[0].text
        v = json.loads(o.outputs[0].text)
        assert set(v) == {"name", "age", "pet"} and 0 <= v["age"] <= 99 and v["pet"] in ("cat", "dog")
        assert len(v["name"]) <= 10
    assert re.fullmatch(r"\d{3}-\d{4}", outs[2].outputs[0].text)
    assert outs[3].outputs[0].text in ("yes", "no")


@pytest.mark.parametrize("steps", [1, 4], ids=["one-step", "multi-step"])
def test_mixed_batch_free_rows_match_alone(make_llm, steps):
    llm = make_llm(num_scheduler_steps=steps)
    alone = [llm.generate([p], sp)[0].outputs[0].token_ids for p, sp in zip(FREE_PROMPTS, FREE)]
    cons = _constrained()
    prompts = [p for p, _ in cons] + FREE_PROMPTS
    params = [sp for _, sp in cons] + FREE
    outs = llm.generate(prompts, params)
    _check_constrained(outs[: len(cons)])
    assert [o.outputs[0].token_ids for o in outs[len(cons) :]] == alone
    if steps > 1:  # the free rows still ran in rounds once the constrained ones were done
        assert llm.engine.num_multi_step_rounds > 0
    s = llm.stats()
    assert s["num_free_blocks"] == s["num_total_blocks"]


def test_structured_checks(make_llm):
    with pytest.raises(ValueError, match="n must be 1"):
        SamplingParams(n=2, structured=StructuredOutput("json_object"))
    llm = make_llm()
    eng = llm.engine
    ids = llm.encode("hi")[1]
    # a grammar that terminates ends the request with "stop" even with ignore_eos
    p = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, structured=StructuredOutput.choice(["ok"]))
    eng.add_request(EngineCoreRequest("r", ids, p))
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    assert outs[-1].finish_reason == "stop"
    assert llm.tokenizer.decode([t for o in outs for t in o.new_token_ids], skip_special_tokens=True) == "ok"


def test_async_rounds_with_grammars_match_one_step(make_llm):
    """Constrained rows in async rounds (forward pass queued, masks filled meanwhile, then the
    draw) give every row, free or constrained, exactly the tokens and logprobs of the one-step path."""
    js = StructuredOutput.json_schema(PERSON)
    prompts = ["A person as JSON:", "Another person as JSON:", "Yes or no?", *FREE_PROMPTS[:2]]
    params = [
        SamplingParams(temperature=0.0, max_tokens=40, structured=js, logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=40, structured=js, logit_bias={33: 5.0}, repetition_penalty=1.3),
        SamplingParams(temperature=0.0, max_tokens=8, structured=StructuredOutput.choice(["yes", "no"])),
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, frequency_penalty=0.5),
    ]
    outs = {}
    for name, use_async in (("one-step", False), ("async", True)):
        llm = make_llm(async_scheduling=use_async)
        res = [o.outputs[0] for o in llm.generate(prompts, params)]
        outs[name] = [(c.token_ids, c.finish_reason, c.logprobs) for c in res]
        for c in res[:2]:
            assert c.finish_reason == "stop" and set(json.loads(c.text)) == {"name", "age", "pet"}, c.text
        assert res[2].text in ("yes", "no")
        rounds = llm.engine.rounds
        # async: the constrained rows ran in rounds, their masks filled behind a queued forward pass
        assert (rounds.num_constrained_rounds > 0 and rounds.num_chained_rounds > 0) == use_async
        s = llm.stats()
        assert s["num_free_blocks"] == s["num_total_blocks"]
    assert outs["async"] == outs["one-step"]
