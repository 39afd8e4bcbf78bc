"""What the engine allows of sleep mode and weight updates (the work is the workers':
worker/sleep_mode.py; the engine's calls are `EngineCore.sleep` / `wake_up` / `update_weights`).

Policy, as documented in docs/sleep_mode.md:
- A request that arrives while the engine sleeps is refused at once (`EngineSleepingError`; the
  server answers 503) rather than queued: a sleeping engine has no KV cache to run it on, and a
  caller that wants requests held pauses generation instead (`AsyncLLM.pause_generation`).
- Sleeping and updating weights need an idle engine (no unfinished request): their KV would be
  lost or computed by other weights. Both drop the prefix cache.
- Sleep level 2 and weight updates reload weights from a checkpoint; they are refused where the
  loaded model's tensors are not plain checkpoint tensors (`weight_reload_refusal`).
"""

from __future__ import annotations

from pagedllm.config import EngineConfig


class EngineSleepingError(RuntimeError):
    """The engine is asleep (`sleep`); it serves again after `wake_up`."""


def weight_reload_refusal(config: EngineConfig) -> str | None:
    """Why this engine cannot reload its weights from a checkpoint (sleep level 2, weight
    updates), or None when it can.

    NOTE(sleep_mode): a GGUF model's linear layers keep per-layer block tables beside their
    tensors, EPLB moves experts between physical slots at run time, LoRA wraps layers with
    adapter slots a fresh model lacks, and a draft model has weights of its own: a reload would
    miss or misplace them.
    """
    mc = config.model_config
    if mc.quantization == "gguf" or str(mc.model).lower().endswith(".gguf"):
        return "a GGUF model's weights cannot be reloaded in place"
    if config.lora_config is not None:
        return "not supported with enable_lora"
    if config.parallel_config.enable_eplb:
        return "not supported with enable_eplb (experts move at run time)"
    spec = config.speculative_config
    if spec is not None and spec.method == "draft_model":
        return "not supported with a draft model"
    return None
