"""Tensor parallelism: one model split across several devices, one rank process per device.

The engine core (scheduler, block pool, prefix cache, KV events, sampling) runs once, in rank 0's
process; it is unchanged by TP. What is split is the model runner: every rank holds a slice of every
projection (`sharding.py`: q/k/v and gate/up by output rows, o and down by input columns, the
embedding and the LM head by vocabulary rows) and its own KV pool with the same block ids, for its
share of the KV heads. Each step, rank 0 plans the step's inputs once and sends the plan to the other
ranks as plain data (`messages.py`); every rank runs the same forward, whose all-reduces (after o and
down, and after the embedding) and one all-gather (the logits) keep the ranks in lock step
(`group.py`). Rank 0 samples; the tokens come back to every rank inside the next step's plan.

`ranks.py` starts and stops the other ranks (``python -P -m kvmesh.engine.parallel.worker``) and
drives them; a rank that dies is noticed by rank 0 (the collectives time out, the process is gone)
and fails the engine rather than hanging it.

A group may span hosts (``tp_nodes``): the leader's host runs rank 0 and its first ranks as above, each
other host runs `kvmesh rank` (`node.py`), and all ranks meet at rank 0's port, where they read the
leader's config and say they are ready, and where each beats a heartbeat that tells rank 0 which host
is gone (`rendezvous.py`).
"""
