"""Incremental detokenization must give exactly the text of a full decode, token by token."""

from __future__ import annotations

import random

import pytest

from kvmesh import SamplingParams
from kvmesh.engine.core.messages import EngineCoreOutput
from kvmesh.engine.frontend.output_processor import RequestState

pytestmark = pytest.mark.unit
TEXTS = [
    "Héllo wörld — naïve café 你好世界 🙂🚀 <|im_end|> code:\n\tdef f(x):\n  return x",
    "  leading spaces and\n\nnewlines",
    "emoji 👩‍👩‍👧 mix ½ ∑ ∫",
]


@pytest.fixture(scope="module")
def tok():
    from kvmesh.engine.models.loader import load_model

    return load_model(None, load_weights=False).tokenizer


@pytest.mark.parametrize("skip", [True, False])
def test_incremental_text_equals_full_decode(tok, skip):
    rng = random.Random(1)
    streams = [tok(t).input_ids for t in TEXTS]
    streams += [[rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 80))] for _ in range(20)]
    for ids in streams:
        st = RequestState("r", None, [1], SamplingParams(max_tokens=500, skip_special_tokens=skip), tok)
        streamed, i = "", 0
        while i < len(ids):
            n = rng.randint(1, 3)
            deltas, _ = st.process(EngineCoreOutput("r", 0, ids[i : i + n]))
            streamed += "".join(d for _, d in deltas)
            i += n
            assert st.result.outputs[0].text == tok.decode(ids[:i], skip_special_tokens=skip)
        deltas, _ = st.process(EngineCoreOutput("r", 0, [], finish_reason="length"))
        streamed += "".join(d for _, d in deltas)
        assert streamed == st.result.outputs[0].text  # the streamed deltas add up to the final text
