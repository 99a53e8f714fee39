"""A rank other than 0: load the checkpoint, keep this rank's slice, run the steps rank 0 sends.

``python -P -m kvmesh.engine.parallel.worker SPEC_JSON RANK`` (started by `ranks.Ranks` on one host),
or ``... --join JOIN_JSON RANK`` in a group across hosts (started by `ranks.Ranks` for the leader's
host, by `kvmesh rank` for another's): the spec then comes from rank 0's rendezvous store
(rendezvous.py). The process exits when rank 0 sends `Stop`, or when a collective fails or the
heartbeat finds rank 0 gone: it never outlives its engine.
"""

from __future__ import annotations

import logging
import sys
import threading
from dataclasses import replace

import msgspec

from kvmesh.common.logs import setup_logging
from kvmesh.engine.config import EngineConfig
from kvmesh.engine.parallel import messages
from kvmesh.engine.parallel.group import TPGroup
from kvmesh.engine.parallel.messages import Join, WorkerSpec
from kvmesh.engine.parallel.ranks import rank_device
from kvmesh.engine.parallel.rendezvous import Member, RendezvousError, gloo_interface

log = logging.getLogger("kvmesh.engine.parallel")


def main(argv: list[str]) -> int:
    member: Member | None = None
    if argv[0] == "--join":
        rank = int(argv[2])
        setup_logging(f"rank {rank}")
        try:
            member = Member(msgspec.json.decode(argv[1], type=Join), rank)
        except RendezvousError as e:
            log.error("%s", e)
            return 2
        spec = member.spec
    else:
        spec = msgspec.json.decode(argv[0], type=WorkerSpec)
        rank = int(argv[1])
        setup_logging(f"rank {rank}")
    try:
        return _run(spec, rank, member)
    finally:
        if member is not None:
            member.stop()


def _run(spec: WorkerSpec, rank: int, member: Member | None) -> int:
    config = msgspec.convert(spec.config, EngineConfig)
    device = rank_device(config, rank)
    config = replace(config, device=str(device))
    from kvmesh.engine.models.loader import load_model
    from kvmesh.engine.runner.model_runner import ModelRunner

    try:
        if device.type == "cuda":
            import torch

            torch.cuda.set_device(device)
        loaded = load_model(config.model_path, load_tokenizer=False)
    except Exception as e:
        if member is not None:  # rank 0 fails now with the reason, not after its timeout
            member.refuse(f"rank {rank} on host {member.host} cannot load {config.model_path} on {device}: {e}")
        raise
    if member is None:
        group = TPGroup(rank, spec.world, spec.init_method, device, spec.timeout_s)
    else:
        member.ready()
        interface = gloo_interface(member.join.address)
        group = TPGroup(rank, spec.world, spec.init_method, device, spec.timeout_s, member.store, interface)
    agents: list = []
    try:
        runner = ModelRunner(config, loaded.state_dict, tp=group)
        del loaded
        while True:
            msg = messages.decode(group.broadcast_bytes(None))
            if isinstance(msg, messages.Stop):
                if member is not None:
                    member.stop()
                group.barrier()  # rank 0 closes its rendezvous store after this
                return 0
            if isinstance(msg, messages.Agents):
                agents.append(_start_agent(runner, group, msg))
                continue
            if isinstance(msg, messages.Step):
                runner.run_step(msg)
            elif isinstance(msg, messages.KvMoves):
                runner.move_kv(msg.moves, msg.wait)
            else:
                runner.lora_message(msg)
    finally:
        for agent in agents:
            agent.stop()
        group.close()


def _start_agent(runner, group: TPGroup, msg: messages.Agents):
    """This rank's NIXL agent on its KV heads; rank 0 gets what a reader needs to pull from it."""
    from kvmesh.engine.connectors.common import BlockLayout
    from kvmesh.engine.connectors.nixl_agent import KVAgent

    layout = BlockLayout.of(runner.kv_cache, runner.kv_scales_id)
    agent = KVAgent(
        f"{msg.name}-rank{group.rank}",
        runner.kv_cache,
        layout,
        msg.backends,
        msg.ucx_error_handling_mode,
        msg.progress_thread,
    )
    heads = runner.rank_blocks.heads
    group.gather_bytes(msgspec.msgpack.encode(agent.describe(layout, (heads.start, heads.stop))))
    return _Progressed(agent)


class _Progressed:
    """A rank's agent with a thread of its own that progresses it. Rank 0's agent is progressed by the
    engine thread every step; this rank's main thread waits in the group's collectives, yet a reader's
    connection setup needs the agent to answer (UCX wire-up). After `describe`, only this thread
    touches the agent (NIXL is not guaranteed thread-safe)."""

    PERIOD_S = 0.002

    def __init__(self, agent) -> None:
        self.agent = agent
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvmesh-nixl-progress", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stopped.wait(self.PERIOD_S):
            try:
                self.agent.notifs()  # progresses the agent's workers; nothing here reads notifications
            except Exception as e:
                log.warning("progressing this rank's NIXL agent failed: %s", e)
                return

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join(5.0)
        self.agent.close()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
