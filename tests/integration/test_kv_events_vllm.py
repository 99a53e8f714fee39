"""Conformance with vLLM itself: kvmesh's KV events decode with vLLM's own event classes, and in the vLLM
prefix-hash mode vLLM's own hash function gives the block hashes kvmesh published.

vLLM is not a kvmesh dependency (it is huge and needs CUDA), so this test downloads the pinned release's
source distribution from PyPI once (47 MB, pinned by version and sha256; the x86_64 wheel is 336 MB and
holds the same .py files) into ~/.cache/kvmesh (or $KVMESH_CACHE_DIR), and takes three files from it:
``vllm/distributed/kv_events.py`` (the event classes, as is), ``vllm/utils/hashing.py`` (``sha256_cbor``,
as is) and ``vllm/v1/core/kv_cache_utils.py``, from which it keeps the top-level definitions that hash
blocks (``init_none_hash``, ``hash_block_tokens``, ``generate_block_hash_extra_keys``,
``get_request_block_hasher``, ``to_event_extra_keys``...), since the whole module imports vLLM's engine.
Their unrelated imports (logger, config, network helpers) get the smallest stand-ins. They run in a
separate interpreter whose sys.path holds only that tree and the site-packages (msgspec, pyzmq, cbor2),
never kvmesh: what it reads is bytes kvmesh wrote.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import subprocess
import sys
import tarfile
import textwrap
import time
import urllib.request
from pathlib import Path

import msgspec
import pytest

from kvmesh.common.hashing import VLLM, block_hashes_for, external_hash
from kvmesh.common.kv_events import MAP, KVEventBatch, encode_batch
from kvmesh.engine.core.kv_cache_manager import KVCacheManager
from kvmesh.engine.core.request import Request
from kvmesh.engine.frontend.sampling_params import SamplingParams

pytestmark = pytest.mark.integration

VLLM_VERSION = "0.33.0"
SDIST = f"vllm-{VLLM_VERSION}.tar.gz"
SDIST_URL = (
    "https://files.pythonhosted.org/packages/f7/25/aa5684e9c59d6fc75f78926b7f15e8d9adc7de2d9e6e7575b80776ad8169/"
    + SDIST
)
SDIST_SHA256 = "f4c33c2503d52bb411146afa9618a4f48bed68912f617e6803ac8d76e4c74112"
FILES = ("vllm/distributed/kv_events.py", "vllm/utils/hashing.py", "vllm/v1/core/kv_cache_utils.py")
# What the hashing tree keeps of kv_cache_utils.py: the block-hash definitions, nothing of the engine.
HASH_DEFS = {
    "BlockHash",
    "ExternalBlockHash",
    "maybe_convert_block_hash",
    "DEFAULT_NONE_HASH_SEED",
    "_NON_CRYPTO_HASH_FUNCTIONS",
    "_NONE_HASH_SEED",
    "resolve_none_hash_seed",
    "init_none_hash",
    "_gen_mm_extra_hash_keys",
    "_gen_lora_extra_hash_keys",
    "_gen_prompt_embeds_extra_hash_keys",
    "generate_block_hash_extra_keys",
    "to_event_extra_keys",
    "hash_block_tokens",
    "get_request_block_hasher",
}
BS = 16
MODEL = "smol@conformance"


def _cache_dir() -> Path:
    d = Path(os.environ.get("KVMESH_CACHE_DIR") or Path.home() / ".cache" / "kvmesh")
    d.mkdir(parents=True, exist_ok=True)
    return d


def _vllm_files() -> Path:
    """The three pinned source files, downloaded and extracted once per machine."""
    root = _cache_dir() / f"vllm-{VLLM_VERSION}-src"
    if all((root / f).exists() for f in FILES):
        return root
    sdist = _cache_dir() / SDIST
    if not sdist.exists() or hashlib.sha256(sdist.read_bytes()).hexdigest() != SDIST_SHA256:
        t = time.monotonic()
        print(f"downloading {SDIST_URL} (vLLM {VLLM_VERSION} sdist, ~47 MB) into {sdist}", flush=True)
        part = sdist.with_suffix(".part")
        urllib.request.urlretrieve(SDIST_URL, part)
        digest = hashlib.sha256(part.read_bytes()).hexdigest()
        assert digest == SDIST_SHA256, f"{SDIST}: sha256 {digest}, pinned {SDIST_SHA256}"
        part.replace(sdist)
        print(f"downloaded in {time.monotonic() - t:.1f}s", flush=True)
    with tarfile.open(sdist) as tar:
        for f in FILES:
            src = tar.extractfile(f"vllm-{VLLM_VERSION}/{f}")
            assert src is not None, f
            (root / f).parent.mkdir(parents=True, exist_ok=True)
            (root / f).write_bytes(src.read())
    print(f"extracted {', '.join(FILES)} into {root}", flush=True)
    return root


STUBS = {
    "vllm/__init__.py": "",
    "vllm/logger.py": "import logging\n\ndef init_logger(name):\n    return logging.getLogger(name)\n",
    "vllm/envs.py": "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES = True  # vLLM's default\n",
    "vllm/config/__init__.py": "",
    "vllm/config/kv_events.py": "class KVEventsConfig:\n    pass\n",
    "vllm/utils/__init__.py": "",
    "vllm/utils/network_utils.py": "def get_ip(): ...\ndef get_tcp_uri(*a): ...\n"
    "def is_valid_ipv6_address(*a): ...\ndef split_zmq_path(*a): ...\n",
    "vllm/distributed/__init__.py": "",
    "vllm/v1/__init__.py": "",
    "vllm/v1/core/__init__.py": "",
}


def _tree(tmp: Path, src: Path) -> Path:
    """vLLM's two files as they are, kv_cache_utils.py cut to its hashing definitions, and the stand-ins."""
    root = tmp / "vllm-tree"
    for rel, text in STUBS.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    for rel in FILES[:2]:
        (root / rel).write_bytes((src / rel).read_bytes())
    full = (src / FILES[2]).read_text()
    kept, defined = [], set()
    for node in ast.parse(full).body:
        names = set()
        if isinstance(node, ast.FunctionDef | ast.ClassDef):
            names = {node.name}
        elif isinstance(node, ast.Assign):
            names = {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names = {node.target.id}
        if names & HASH_DEFS:
            kept.append(ast.get_source_segment(full, node) or "")
            defined |= names
    assert defined >= HASH_DEFS, f"vLLM {VLLM_VERSION}'s kv_cache_utils.py lacks {HASH_DEFS - defined}"
    header = (
        "import hashlib, os\nfrom collections.abc import Callable, Iterable, Sequence\n"
        "from typing import Any, NewType, TypeAlias\nfrom vllm import envs\n"
        "from vllm.logger import init_logger\nfrom vllm.utils.hashing import xxhash, xxhash_cbor\n"
        "logger = init_logger(__name__)\nNONE_HASH = None\n"
        "Request = Any\n"
    )
    (root / FILES[2]).write_text(header + "\n\n".join(kept) + "\n")
    return root


# Runs in the separate interpreter: decodes kvmesh's payloads with vLLM's classes, hashes the prompts with
# vLLM's request block hasher, and prints both as JSON.
CHILD = textwrap.dedent(
    """
    import json, sys, types
    import msgspec
    from vllm.distributed.kv_events import KVEventBatch, BlockStored, BlockRemoved, AllBlocksCleared
    from vllm.utils.hashing import sha256_cbor
    from vllm.v1.core import kv_cache_utils as u

    job = json.load(open(sys.argv[1]))
    dec = msgspec.msgpack.Decoder(KVEventBatch)
    batches = []
    for hexed in job["payloads"]:
        b = dec.decode(bytes.fromhex(hexed))
        out = []
        for ev in b.events:
            d = {"type": type(ev).__name__}
            d.update({k: getattr(ev, k) for k in ev.__struct_fields__})
            out.append(d)
        batches.append(out)
    u.init_none_hash(sha256_cbor)
    hashed = []
    for p in job["prompts"]:
        req = types.SimpleNamespace(
            block_hashes=[], all_token_ids=p["ids"], num_tokens=len(p["ids"]), mm_features=None,
            lora_request=None, cache_salt=p["salt"], prompt_embeds=None,
        )
        hs = u.get_request_block_hasher(job["block_size"], sha256_cbor)(req)
        keys = [u.generate_block_hash_extra_keys(req, i * job["block_size"], (i + 1) * job["block_size"], 0)[0]
                for i in range(len(hs))]
        hashes = [u.maybe_convert_block_hash(h) for h in hs]
        hashed.append({"hashes": hashes, "event_keys": u.to_event_extra_keys(keys)})
    try:
        import kvmesh  # noqa: F401
        sees_kvmesh = True
    except ImportError:
        sees_kvmesh = False
    print(json.dumps({"batches": batches, "hashed": hashed, "sees_kvmesh": sees_kvmesh}, default=list))
    """
)


def _kvmesh_events(prompts: list[tuple[list[int], str | None]], scheme: str) -> list[bytes]:
    """The payloads a kvmesh pod publishes for these prompts: its pool's events, one batch per prompt."""
    kv = KVCacheManager(64, BS, event_format=MAP)
    out = []
    for i, (ids, salt) in enumerate(prompts):
        req = Request(f"r{i}", ids, SamplingParams(max_tokens=1), BS, MODEL, cache_salt=salt, prefix_hash=scheme)
        assert kv.allocate_slots(req, req.num_tokens) is not None
        kv.free(req)
        out.append(encode_batch(KVEventBatch(time.time(), kv.pool.take_events())))
    kv.pool.get_new_blocks(64)  # evicts them all: BlockRemoved
    out.append(encode_batch(KVEventBatch(time.time(), kv.pool.take_events())))
    kv.pool.free_blocks(kv.pool.blocks)
    assert kv.pool.reset_prefix_cache()
    out.append(encode_batch(KVEventBatch(time.time(), kv.pool.take_events())))
    return out


def _run_vllm(tmp_path: Path, payloads: list[bytes], prompts) -> dict:
    tree = _tree(tmp_path, _vllm_files())
    job = tmp_path / "job.json"
    job.write_text(
        json.dumps(
            {
                "payloads": [p.hex() for p in payloads],
                "prompts": [{"ids": ids, "salt": salt} for ids, salt in prompts],
                "block_size": BS,
            }
        )
    )
    (tmp_path / "child.py").write_text(CHILD)
    site = [p for p in sys.path if p.endswith("site-packages")]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHASHSEED")}
    env["PYTHONPATH"] = os.pathsep.join([str(tree), *site])
    r = subprocess.run(
        [sys.executable, "-P", "-S", str(tmp_path / "child.py"), str(job)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert not got["sees_kvmesh"]  # vLLM's side reads kvmesh's bytes, never its code
    return got


PROMPTS = [
    (list(range(100, 148)), None),  # 3 blocks, no salt
    (list(range(100, 148)) + list(range(7, 30)), None),  # the same prefix, then 1 more full block
    (list(range(100, 148)), "tenant-a"),  # salted: the whole chain differs
]


def test_vllm_decodes_kvmesh_events_and_hashes_its_blocks(tmp_path):
    payloads = _kvmesh_events(PROMPTS, VLLM)
    got = _run_vllm(tmp_path, payloads, PROMPTS)
    batches = got["batches"]
    # vLLM's own hash of every prompt is what kvmesh's vLLM mode computes ...
    for (ids, salt), h in zip(PROMPTS, got["hashed"], strict=True):
        assert h["hashes"] == [external_hash(x) for x in block_hashes_for(ids, BS, MODEL, salt, scheme=VLLM)]
    # ... and what kvmesh published, with the token ids, parents and extra keys vLLM would publish
    stored = [ev for b in batches[: len(PROMPTS)] for ev in b]
    assert [ev["type"] for ev in stored] == ["BlockStored"] * 3
    first, second, salted = stored
    h0, h1, h2 = got["hashed"]
    assert first["block_hashes"] == h0["hashes"] and first["parent_block_hash"] is None
    assert first["token_ids"] == PROMPTS[0][0] and first["block_size"] == BS and first["medium"] == "GPU"
    assert first["lora_name"] is None and first["lora_id"] is None and first["group_idx"] == 0
    assert first["extra_keys"] == h0["event_keys"] == [None, None, None]  # one entry per block, as vLLM
    # the second prompt's first three blocks were cached: only its 4th is new, its parent the 3rd
    assert second["block_hashes"] == h1["hashes"][3:] and second["parent_block_hash"] == h1["hashes"][2]
    assert second["token_ids"] == PROMPTS[1][0][48:64]
    assert salted["block_hashes"] == h2["hashes"] and set(salted["block_hashes"]).isdisjoint(h0["hashes"])
    assert [list(k) if k else k for k in salted["extra_keys"]] == [list(k) if k else k for k in h2["event_keys"]]
    assert salted["extra_keys"][0] == ["tenant-a"]  # the salt, published as vLLM publishes it
    removed = batches[len(PROMPTS)]
    assert all(ev["type"] == "BlockRemoved" and ev["group_idx"] == 0 and ev["medium"] == "GPU" for ev in removed)
    assert sorted(h for ev in removed for h in ev["block_hashes"]) == sorted(
        h for ev in stored for h in ev["block_hashes"]
    )
    assert batches[-1] == [{"type": "AllBlocksCleared"}]


def test_vllm_decodes_kvmesh_scheme_events_too(tmp_path):
    """The default scheme's events decode with vLLM's classes as well (their hashes are kvmesh's own)."""
    payloads = _kvmesh_events(PROMPTS[:1], "kvmesh")
    got = _run_vllm(tmp_path, payloads, PROMPTS[:1])
    (ev,) = got["batches"][0]
    assert ev["type"] == "BlockStored" and ev["token_ids"] == PROMPTS[0][0]
    assert ev["block_hashes"] == [external_hash(h) for h in block_hashes_for(PROMPTS[0][0], BS, MODEL)]
    assert ev["block_hashes"] != got["hashed"][0]["hashes"]
    assert ev["extra_keys"][0] == [MODEL] and msgspec.msgpack.decode(payloads[0])[1][0]["type"] == "BlockStored"
