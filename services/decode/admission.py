"""A decode pod's admission of a request that brings a prefill pod's KV.

The router sends a decode pod the prefill pod's answer, ``kv_transfer_params``: where the prompt's
blocks are (host, port, transfer id, block ids), their chained hash and the sender's KV layout. This
pod admits it in two steps:

1. here, in the API process, before anything is queued: the params' shape and types
   (`check_kv_transfer_params`, engine/connectors/transfer_params.py, which the connectors run again); a bad
   request gets a 400 naming the field instead of a silent recompute;
2. in the engine, by the connector (the transport): is the prefill engine there and able to serve
   (engine/connectors/nixl_admission.py), then after the READ, are the blocks the prompt's (the
   chained hash) and of this pod's layout (dtype, block shape, FP8 scales). A pull that fails either
   check is refused and counted (``kvmesh:kv_transfer_refused{reason}``); the prompt is recomputed here.
"""

from __future__ import annotations

from typing import Any

from kvmesh.engine.connectors.transfer_params import check_kv_transfer_params
from kvmesh.services.errors import bad_request


def admit_kv_transfer_params(params: Any) -> None:
    """Raise the API's 400 (`bad_request`, param ``kv_transfer_params``) for params no connector could use."""
    problem = check_kv_transfer_params(params)
    if problem is not None:
        raise bad_request(problem, "kv_transfer_params")
