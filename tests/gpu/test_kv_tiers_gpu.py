"""The host and disk KV tiers' copies on a GPU (engine/runner/host_kv.py): offloads and loads on the
copy stream, spills that wait for it, disk loads through a pinned staging block; in plan order, with
the compute stream writing the pool between batches, every block ends with the right bytes."""

from __future__ import annotations

import os

import pytest
import torch

from kvmesh.engine.core.host_pool import DISK_LOAD, LOAD, OFFLOAD, SPILL
from kvmesh.engine.runner.host_kv import DiskKV, HostKV

pytestmark = pytest.mark.gpu


def test_blocks_go_device_host_disk_and_back(tmp_path):
    kv = torch.empty((8, 2, 2, 16, 2, 64), dtype=torch.bfloat16, device="cuda")
    for b in range(8):
        kv[b].fill_(b + 1)
    want = kv.clone()
    disk = DiskKV(4, kv[0], str(tmp_path))
    assert os.listdir(tmp_path) == []
    host = HostKV(2, kv, disk)
    host.apply([(OFFLOAD, 0, 0), (OFFLOAD, 1, 1)])  # blocks 0 and 1 -> host slots 0 and 1
    kv[0].fill_(-1)  # the compute stream reuses block 0 right after (waits on the copy stream)
    # host slot 0 goes to disk before block 2 takes it; then both come back into blocks 5 and 6
    host.apply([(SPILL, 0, 3), (OFFLOAD, 2, 0), (DISK_LOAD, 3, 5), (LOAD, 1, 6)])
    kv[2].fill_(-2)
    host.apply([(LOAD, 0, 7)])  # block 2's copy, from host slot 0
    torch.cuda.synchronize()
    assert torch.equal(kv[5], want[0]) and torch.equal(kv[6], want[1]) and torch.equal(kv[7], want[2])
    assert host.tier_bytes["DISK"] == {"in": kv[0].numel() * 2, "out": kv[0].numel() * 2}
    secs = host.load_seconds()
    assert secs["DISK"] > 0 and secs["CPU"] > 0
    host.close()
    assert disk.fd is None
