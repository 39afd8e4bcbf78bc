"""Multi-LoRA serving (docs/lora.md): the request type, PEFT adapter loading, the engine's LoRA
settings, the worker's adapter slots and the layers that apply them.

`request` and `config` are plain Python (the scheduler side imports them); everything else is
worker side.
"""
