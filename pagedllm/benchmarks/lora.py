"""The multi-LoRA workload of `pagedllm bench throughput --num-loras N`: N random rank-R
adapters on every linear layer of the model, MoE experts included (PEFT's format, written
here without `peft`),
request i under adapter i mod N, and the HF + peft baseline, which serves one adapter at a
time (static batches of each adapter's requests, `set_adapter` between them), as HF must.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch

from pagedllm.benchmarks.report import PeakRSSMonitor
from pagedllm.benchmarks.throughput import throughput_figures, warmup_prompt
from pagedllm.benchmarks.workload import BenchRequest
from pagedllm.hf_config import read_hf_config
from pagedllm.lora.config import check_lora_architectures
from pagedllm.lora.peft import LoRAModelShapes
from pagedllm.lora.request import LoRARequest


def write_random_adapters(model_path: str, folder: str | Path, num_loras: int, rank: int,
                          seed: int = 0) -> list[LoRARequest]:
    """Write `num_loras` random adapters of `rank` on every linear layer of the model at
    `model_path` under `folder` (A uniform in +-1/sqrt(in_features) as PEFT's init, B normal
    with std 0.02, lora_alpha = 2 * rank); returns their requests (ids 1..num_loras).
    Raises ValueError for an architecture the engine has no LoRA support for.

    On a MoE model this is every projection of every layer (attention, dense layers' MLPs,
    shared experts) and the routed experts in transformers 5's layout (PEFT's
    `target_parameters` on `mlp.experts.gate_up_proj` and `mlp.experts.down_proj`: A [E r, in]
    rows expert-major, B [out, r E] columns expert-minor, gate_up nested under down)."""
    from safetensors.torch import save_file

    hf_config = read_hf_config(model_path)
    check_lora_architectures(hf_config.get("architectures") or [])   # before any file is written
    shapes = LoRAModelShapes.from_hf_config(hf_config)
    generator = torch.Generator().manual_seed(seed)

    def pair(name: str, a_rows: int, in_features: int, out_features: int, b_cols: int) -> dict:
        bound = in_features ** -0.5
        return {f"{name}.lora_A.weight": (torch.rand(a_rows, in_features, generator=generator)
                                          * 2 - 1) * bound,
                f"{name}.lora_B.weight": torch.randn(out_features, b_cols,
                                                     generator=generator) * 0.02}

    attention = ("q_proj", "k_proj", "v_proj", "o_proj", "q_a_proj", "q_b_proj",
                 "kv_a_proj_with_mqa")

    def block(module: str) -> str:
        return "self_attn" if module in attention else "mlp"

    # Targets named with their block ("mlp.shared_expert.gate_proj", not "gate_proj"): PEFT
    # >= 0.22 reads a bare "gate_proj" / "up_proj" on a transformers-5 MoE model as the
    # pre-fusion experts too and would adapt the fused gate_up_proj at twice the rank.
    modules = sorted({f"{block(m)}.{m}" for layer in range(shapes.num_layers)
                      for m in shapes.layer_modules(layer)})
    loras = []
    for k in range(num_loras):
        path = Path(folder) / f"lora-{k}"
        path.mkdir(parents=True, exist_ok=True)
        tensors = {}
        for layer in range(shapes.num_layers):
            prefix = f"base_model.model.model.layers.{layer}"
            for module, (in_features, out_features) in shapes.layer_modules(layer).items():
                tensors.update(pair(f"{prefix}.{block(module)}.{module}", rank, in_features,
                                    out_features, rank))
            if shapes.is_sparse(layer):
                experts, hidden, inter = shapes.experts
                tensors.update(pair(f"{prefix}.mlp.experts.base_layer", experts * rank, hidden,
                                    2 * inter, rank * experts))
                tensors.update(pair(f"{prefix}.mlp.experts", experts * rank, inter, hidden,
                                    rank * experts))
        save_file(tensors, str(path / "adapter_model.safetensors"))
        config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank,
                  "lora_alpha": 2 * rank, "target_modules": modules, "lora_dropout": 0.0,
                  "bias": "none", "base_model_name_or_path": str(model_path)}
        if shapes.experts is not None:
            config["target_parameters"] = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
        (path / "adapter_config.json").write_text(json.dumps(config))
        loras.append(LoRARequest(f"lora-{k}", k + 1, str(path)))
    return loras


def request_loras(num_requests: int, loras: list[LoRARequest]) -> list[LoRARequest]:
    """Request i's adapter: loras[i mod len(loras)]."""
    return [loras[i % len(loras)] for i in range(num_requests)]


def run_hf_peft_throughput(model_path: str, requests: list[BenchRequest],
                           loras: list[LoRARequest], dtype: torch.dtype, batch_size: int
                           ) -> tuple[dict[str, Any], list[list[int]]]:
    """HF `generate` + peft over the workload, one adapter at a time: each adapter's requests
    (`request_loras`) in static batches of `batch_size`. Returns `run_hf_throughput`'s figures
    and output token ids per request (workload order).

    Raises:
        ImportError: when `peft` is not installed.
    """
    from peft import PeftModel

    from pagedllm.benchmarks.hf_baseline import hf_generate_batch, load_hf_model

    per_request = request_loras(len(requests), loras)
    with PeakRSSMonitor() as mem:
        model = PeftModel.from_pretrained(load_hf_model(model_path, dtype), loras[0].lora_path,
                                          adapter_name=loras[0].lora_name)
        for lora in loras[1:]:
            model.load_adapter(lora.lora_path, adapter_name=lora.lora_name)
        model.eval()
        hf_generate_batch(model, [warmup_prompt(requests)], 4)
        outputs: list[list[int]] = [[] for _ in requests]
        start = time.perf_counter()
        for lora in loras:
            model.set_adapter(lora.lora_name)
            mine = [i for i, r in enumerate(per_request) if r is lora]
            for b in range(0, len(mine), batch_size):
                batch = mine[b:b + batch_size]
                tokens = hf_generate_batch(model, [requests[i].prompt_token_ids for i in batch],
                                           max(requests[i].output_len for i in batch))
                for i, t in zip(batch, tokens):
                    outputs[i] = t[:requests[i].output_len]
        elapsed = time.perf_counter() - start
    figures = throughput_figures("hf+peft", requests, outputs, elapsed, mem.peak_bytes)
    figures["batch_size"] = batch_size
    return figures, outputs
