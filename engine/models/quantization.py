"""FP8 (e4m3) weights for the decoder's projections (``--quantization fp8``).

Two sources, one result: every layer's ``qkv``, ``o``, ``gate_up`` and ``down`` weight becomes a
`kvmesh.kernels.Fp8Weight` (e4m3, one float32 scale per output channel), which the kernels take
in place of a float tensor; embeddings, ``lm_head`` and norms stay in the model's dtype.

* Online: a float checkpoint quantized layer by layer as the model is built (`LayerQuantizer`),
  each output channel's largest magnitude mapped to 448.
* Pre-quantized: a checkpoint whose ``config.json`` has a ``quantization_config`` in one of the
  layouts vLLM reads (`kvmesh.common.model_files.checkpoint_quantization`, torch-free: it is read
  with the config): ``quant_method: fp8`` (e4m3 ``weight`` with ``weight_scale`` per tensor or per
  channel, ``input_scale`` per tensor when activations are static) or ``compressed-tensors``
  (float-quantized 8-bit weights, strategy ``channel`` or ``tensor``, activations dynamic per token
  or static per tensor). The model code casts the e4m3 weights to its dtype, which holds every e4m3
  value exactly; `quantize_model` casts them back and attaches the checkpoint's scales.

Fused weights: the q, k and v (gate and up) projections' scales are expanded to one per output
channel and concatenated, which is exact; their static input scales, if any, become the largest
of the three (two), as vLLM fuses them.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch

from kvmesh.common.model_files import QuantizationError
from kvmesh.engine.models.decoder import DenseMLP
from kvmesh.kernels import Fp8Weight, quantize_weight
from kvmesh.kernels.reference import FP8

log = logging.getLogger("kvmesh.engine")

# The model's fused projections (engine/models/decoder.py: layer dicts and DenseMLP) and the checkpoint
# projections each one concatenates, in order.
FUSED: dict[str, tuple[str, ...]] = {
    "qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "o": ("self_attn.o_proj",),
    "gate_up": ("mlp.gate_proj", "mlp.up_proj"),
    "down": ("mlp.down_proj",),
}


def _channel_scale(sd: Mapping[str, torch.Tensor], name: str, rows: int) -> torch.Tensor:
    """A checkpoint's weight scale (per tensor ``[]``/``[1]``, or per channel ``[N]``/``[N, 1]``)
    as ``[rows]`` float32."""
    s = sd.get(name + ".weight_scale")
    if s is None:
        raise QuantizationError(f"{name}.weight is e4m3 but {name}.weight_scale is missing")
    s = s.float().reshape(-1)
    if s.numel() == 1:
        return s.expand(rows)
    if s.numel() != rows:
        raise QuantizationError(f"{name}.weight_scale has {s.numel()} values for {rows} rows")
    return s


def _from_checkpoint(sd: Mapping[str, torch.Tensor], names: list[str], fused: torch.Tensor) -> Fp8Weight:
    scales = [_channel_scale(sd, n, sd[n + ".weight"].shape[0]) for n in names]
    inputs = [sd.get(n + ".input_scale") for n in names]
    if any(i is not None for i in inputs) and not all(i is not None for i in inputs):
        raise QuantizationError(f"input_scale on some of {names} but not all")
    input_scale = None
    if inputs[0] is not None:
        input_scale = torch.stack([i.float().reshape(()) for i in inputs if i is not None]).amax()
        input_scale = input_scale.to(fused.device)
    q = fused.to(FP8)  # exact: the model widened the e4m3 values to its dtype
    return Fp8Weight(q.contiguous(), torch.cat(scales).to(fused.device).contiguous(), input_scale)


def _projections(layer: dict[str, Any]) -> list[tuple[Any, str]]:
    """``(holder, key)`` of each of a layer's `FUSED` projections: attention's on the layer dict,
    a dense MLP's on its `DenseMLP`. A mixture-of-experts MLP's experts stay in float (the fused-MoE
    kernel reads stacked float experts); its router gate is small and stays float too."""
    out: list[tuple[Any, str]] = [(layer, "qkv"), (layer, "o")]
    if isinstance(layer.get("mlp"), DenseMLP):
        out += [(layer["mlp"], "gate_up"), (layer["mlp"], "down")]
    return out


def _get(holder: Any, key: str) -> Any:
    return holder.get(key) if isinstance(holder, dict) else getattr(holder, key, None)


def _set(holder: Any, key: str, value: Any) -> None:
    if isinstance(holder, dict):
        holder[key] = value
    else:
        setattr(holder, key, value)


class LayerQuantizer:
    """Replaces one built layer's projection weights with `Fp8Weight`s: from the checkpoint's e4m3
    weights and scales where ``state_dict`` holds them, else, when ``online``, quantized from the
    float weights. A pre-quantized checkpoint is loaded with ``online=False``: a projection it keeps
    in float (its ``ignore`` list) stays in float, as its authors chose.

    Called per layer while the model is built (the decoder's ``on_layer``), so each layer's float
    weights are freed before the next layer is read; `quantize_model` runs it over a built model."""

    def __init__(self, state_dict: Mapping[str, torch.Tensor], online: bool = True) -> None:
        self.state_dict = state_dict
        self.online = online
        self.replaced = 0
        self.from_checkpoint = 0

    def __call__(self, i: int, layer: Any) -> None:
        for holder, key in _projections(layer):
            w = _get(holder, key)
            if w is None or isinstance(w, Fp8Weight):
                continue
            names = [f"model.layers.{i}.{p}" for p in FUSED[key]]
            sd = self.state_dict
            kinds = {sd_w.dtype == FP8 for sd_w in (sd.get(nm + ".weight") for nm in names) if sd_w is not None}
            if len(kinds) > 1:
                raise QuantizationError(f"layer {i}: {key} mixes e4m3 and float checkpoint weights")
            if kinds != {True} and not self.online:
                continue
            _set(holder, key, _from_checkpoint(sd, names, w) if kinds == {True} else quantize_weight(w))
            self.replaced += 1
            self.from_checkpoint += kinds == {True}

    def log(self) -> None:
        n, pre = self.replaced, self.from_checkpoint
        log.info("fp8: %d projection weights in e4m3 (%d from the checkpoint, %d quantized at load)", n, pre, n - pre)


def quantize_model(model: Any, state_dict: Mapping[str, torch.Tensor], online: bool = True) -> int:
    """`LayerQuantizer` over every layer of a built ``model`` (a decoder of engine/models/decoder.py:
    layer dicts, `DenseMLP` or MoE MLPs). Returns how many weights were replaced."""
    q = LayerQuantizer(state_dict, online)
    for i, layer in enumerate(model.layers):
        q(i, layer)
    q.log()
    return q.replaced


# The ``quantization_config`` of a checkpoint whose projections `fp8_state_dict_entries` wrote:
# compressed-tensors, e4m3 weights with a scale per output channel, dynamic per-token activations.
COMPRESSED_TENSORS_FP8 = {
    "quant_method": "compressed-tensors",
    "format": "float-quantized",
    "quantization_status": "compressed",
    "ignore": ["lm_head"],
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "dynamic": False, "symmetric": True},
            "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True},
        }
    },
}


def fp8_state_dict_entries(name: str, w: torch.Tensor) -> dict[str, torch.Tensor]:
    """``{name.weight: e4m3, name.weight_scale: [N, 1] float32}`` for one float projection: the
    tensors a compressed-tensors checkpoint (channel strategy, `COMPRESSED_TENSORS_FP8`) stores for it."""
    q = quantize_weight(w)
    return {name + ".weight": q.weight, name + ".weight_scale": q.scale[:, None].contiguous()}


def fp8_before_split(state_dict: Mapping[str, torch.Tensor], num_layers: int) -> dict[str, torch.Tensor]:
    """``state_dict`` with every float projection `quantize_model` would quantize replaced by its e4m3
    weight and per-channel scale (`fp8_state_dict_entries`), for tensor parallelism to slice like a
    pre-quantized checkpoint: the same e4m3 values and scales as one rank's online quantization."""
    out = dict(state_dict)
    for name in quantized_projection_names(num_layers):
        w = out.get(name + ".weight")
        if w is not None and w.dtype != FP8:
            out.update(fp8_state_dict_entries(name, w))
    return out


def quantized_projection_names(num_layers: int) -> list[str]:
    """Every projection `quantize_model` turns into FP8, by checkpoint name (without ``.weight``)."""
    return [f"model.layers.{i}.{p}" for i in range(num_layers) for parts in FUSED.values() for p in parts]
