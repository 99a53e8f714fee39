"""Multi-LoRA serving: PEFT adapters read and checked (adapter.py), their device slot pool in the
decoder (pool.py), and the engine's registry and slot assignment (manager.py).

A batch mixes rows of several adapters and of the base model: each token carries its adapter's slot
(-1: the base model) and every LoRA projection is one batched shrink and expand over those slots
(kernels/lora.py), so one CUDA graph serves any mix.
"""

from kvmesh.engine.lora.adapter import LORA_MODULES, LoraAdapter, LoraError, load_adapter
from kvmesh.engine.lora.manager import LoraManager
from kvmesh.engine.lora.pool import LoraPool

__all__ = ["LORA_MODULES", "LoraAdapter", "LoraError", "LoraManager", "LoraPool", "load_adapter"]
