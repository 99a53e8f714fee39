"""The model runner: a scheduler step's plain data in, last-token logits (or a decode round) out."""

from kvmesh.engine.runner.model_runner import ModelRunner

__all__ = ["ModelRunner"]
