"""LoRA adapters for tests: made with ``peft`` on the HF model of the embedded weights, saved as a
user's fine-tune would be (tests/ is on the test runner's path, as for model_checks)."""

from __future__ import annotations

import copy

import torch


def make_adapter(
    hf_model, path: str, rank: int, alpha: int, targets: list[str], rslora: bool, scale: float, seed: int, **kw
):
    """A PEFT LoRA adapter on the HF model, saved in ``path``; returns the PEFT model (a copy of ``hf_model``)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    cfg = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        target_modules=targets,
        lora_dropout=0.0,
        use_rslora=rslora,
        init_lora_weights=False,
        **kw,
    )
    model = get_peft_model(copy.deepcopy(hf_model), cfg)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.mul_(scale)
    model.save_pretrained(path)
    model.eval()
    return model
