"""Host values onto the device without making the host wait.

``torch.tensor(values, device="cuda")`` copies from pageable memory, a blocking copy that
synchronises the stream: the host waits for all the work queued before it (a whole forward
pass, when a decode round is in flight). Copied from pinned memory, the transfer is queued
on the stream like a kernel, and PyTorch keeps the pinned buffer alive until it is done.
"""

from __future__ import annotations

import numpy as np
import torch


def to_device(values, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """``values`` (a list or a numpy array) as a ``dtype`` tensor on ``device``, queued, no host wait."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    if isinstance(values, np.ndarray):  # torch.tensor(ndarray, pin_memory=True) is refused
        host = torch.from_numpy(np.ascontiguousarray(values)).to(dtype).pin_memory()
    else:
        host = torch.tensor(values, dtype=dtype, pin_memory=True)
    return host.to(device, non_blocking=True)
