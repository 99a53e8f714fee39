"""The HF oracle as the engine's greedy runs compare with it (tokens per prompt, cut where the engine stops),
and where a module's `kvmesh serve` writes its log."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def hf_greedy(hf_model, smol):
    """``hf_greedy(prompts, max_new_tokens, **generate_kw)``: HF's greedy tokens for each prompt (token ids),
    each list cut after its first EOS, as the engine stops there unless told to ignore it."""
    import torch

    eos = set(smol.config.eos_token_ids)

    def generate(prompts: list[list[int]], max_new_tokens: int, **kw) -> list[list[int]]:
        out = []
        with torch.inference_mode():
            for ids in prompts:
                x = torch.tensor([ids])
                g = hf_model.generate(
                    x,
                    max_new_tokens=max_new_tokens,
                    do_sample=False,
                    attention_mask=torch.ones_like(x),
                    pad_token_id=2,
                    **kw,
                )[0, len(ids) :].tolist()
                out.append(g[: next((i + 1 for i, t in enumerate(g) if t in eos), len(g))])
        return out

    return generate


@pytest.fixture(scope="module")
def serve_log(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The log file of the module's `kvmesh serve`, in a folder named after the test file: a failed module's
    server log is found by the file's name under pytest's base temp folder (it keeps the last three runs).

    A module's server fixture starts it as ``with ServerProcess(args, env=ENV, log_path=serve_log) as srv:
    yield srv``: yielding inside the ``with`` stops the server's process group at teardown, and also when
    pytest closes the fixture without finishing it."""
    return str(tmp_path_factory.mktemp(request.path.stem) / "server.log")
