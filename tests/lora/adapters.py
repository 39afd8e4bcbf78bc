"""Random PEFT LoRA adapters for tiny checkpoints, made with `peft` itself.

PEFT initialises B to zero (an adapter that changes nothing), so B is drawn at random before
saving; A keeps PEFT's own initialisation.
"""

from __future__ import annotations

from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]

# name -> (rank, target modules, lora_alpha, use_rslora)
ADAPTERS = {
    "r4": (4, ALL_LINEAR, 8, False),
    "r8_attn": (8, ATTENTION, 16, True),
    "r16": (16, ALL_LINEAR, 16, False),
}


def make_peft_adapter(base: Path, out: Path, rank: int, targets: list[str], alpha: float,
                      use_rslora: bool, seed: int, b_std: float = 0.2,
                      parameters: list[str] | None = None) -> Path:
    """Save a PEFT LoRA adapter of `base` with random non-zero B matrices in `out`
    (`parameters`: PEFT's `target_parameters`, e.g. a MoE block's 3-D expert weights)."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=alpha,
                                                  target_modules=targets, lora_dropout=0.0,
                                                  use_rslora=use_rslora,
                                                  target_parameters=parameters))
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, b_std)
    peft_model.save_pretrained(out)
    return out


def make_adapters(base: Path, folder: Path) -> dict[str, Path]:
    """Every adapter of ADAPTERS for `base`, under `folder`."""
    return {name: make_peft_adapter(base, folder / name, rank, targets, alpha, rslora, seed)
            for seed, (name, (rank, targets, alpha, rslora)) in enumerate(ADAPTERS.items())}
