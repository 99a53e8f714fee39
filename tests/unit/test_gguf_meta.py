"""The GGUF header reader that configures workers which do not load weights (``--simulate``, the
API process): it must read what gguf's own reader reads, and hand a file it cannot read back to it."""

from __future__ import annotations

import pytest

from kvmesh.engine.loader import (
    ModelLoadError,
    _gguf_meta_from_reader,
    _open_gguf,
    embedded_model_path,
    load_model,
    read_gguf_meta,
)

pytestmark = pytest.mark.unit


def test_header_reader_matches_gguf_reader_on_the_embedded_model():
    path = embedded_model_path()
    fast = read_gguf_meta(path)
    ref = _gguf_meta_from_reader(_open_gguf(path))
    assert fast.fields == {k: v for k, v in ref.fields.items() if not k.startswith("GGUF.")}
    assert fast.array_len == ref.array_len and fast.array_len["tokenizer.ggml.tokens"] == 49152
    assert fast.tensor_names == ref.tensor_names and "blk.29.ffn_down.weight" in fast.tensor_names
    cfg = load_model(path, load_weights=False, load_tokenizer=False).config
    assert (cfg.vocab_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads) == (49152, 30, 9, 3)
    assert cfg.tie_word_embeddings and cfg.eos_token_ids == (2,)


def test_truncated_header_is_refused_and_falls_back_to_a_clear_error(tmp_path):
    whole = open(embedded_model_path(), "rb").read(2 << 20)  # header (metadata + tensor infos) is ~1.8 MB
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole[:5000])  # inside the vocabulary array
    with pytest.raises(ValueError, match="corrupt|past the end"):
        read_gguf_meta(str(cut))
    with pytest.raises(ModelLoadError, match="GGUF"):
        load_model(str(cut), load_weights=False, load_tokenizer=False)
