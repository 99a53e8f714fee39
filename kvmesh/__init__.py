"""kvmesh: Kubernetes-native LLM serving.

Heavy parts (torch, the engine) load lazily so `kvmesh.operator` and the router
stay light to import.
"""

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str):
    if name == "LLM":
        from kvmesh.engine.frontend.llm import LLM

        return LLM
    if name == "SamplingParams":
        from kvmesh.engine.frontend.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'kvmesh' has no attribute {name!r}")
