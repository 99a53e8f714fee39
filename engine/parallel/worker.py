"""A rank other than 0: load the checkpoint, keep this rank's slice, run the steps rank 0 sends.

``python -P -m kvmesh.engine.parallel.worker SPEC_JSON RANK`` (started by `ranks.Ranks`). The process
exits when rank 0 sends `Stop`, or when a collective fails (rank 0 gone): it never outlives its engine.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import replace

import msgspec

from kvmesh.common.logs import setup_logging
from kvmesh.engine.config import EngineConfig
from kvmesh.engine.parallel import messages
from kvmesh.engine.parallel.group import TPGroup
from kvmesh.engine.parallel.ranks import WorkerSpec, rank_device

log = logging.getLogger("kvmesh.engine.parallel")


def main(argv: list[str]) -> int:
    spec = msgspec.json.decode(argv[0], type=WorkerSpec)
    rank = int(argv[1])
    setup_logging(f"rank {rank}")
    config = msgspec.convert(spec.config, EngineConfig)
    device = rank_device(config, rank)
    config = replace(config, device=str(device))
    if device.type == "cuda":
        import torch

        torch.cuda.set_device(device)
    from kvmesh.engine.models.loader import load_model
    from kvmesh.engine.runner.model_runner import ModelRunner

    loaded = load_model(config.model_path, load_tokenizer=False)
    group = TPGroup(rank, spec.world, spec.init_method, device, spec.timeout_s)
    try:
        runner = ModelRunner(config, loaded.state_dict, tp=group)
        del loaded
        while True:
            msg = messages.decode(group.broadcast_bytes(None))
            if isinstance(msg, messages.Stop):
                return 0
            runner.run_step(msg)
    finally:
        group.close()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
