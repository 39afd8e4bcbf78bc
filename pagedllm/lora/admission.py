"""The front end's LoRA gate: every request's adapter is checked once, before it is queued.

`LoRAAdmission.check` reads and checks the adapter (lora/peft.py) the first time an id is seen
and remembers the id -> adapter binding, so a second name or path under one id (which would let
two adapters share KV blocks and slots) is refused. Checked adapters are remembered in an LRU
of `max_cpu_loras` entries; an adapter that fell out is read again at its next request.
"""

from __future__ import annotations

from collections import OrderedDict

from pagedllm.lora.config import LoRAConfig
from pagedllm.lora.peft import LoRAModelShapes, load_peft_adapter
from pagedllm.lora.request import LoRARequest


class LoRAAdmission:
    """Checks requests' adapters against the engine's LoRA settings and the model.

    Args:
        lora_config: the engine's LoRA settings (None: LoRA is off; any adapter is refused).
        shapes: the model's projection shapes.
    """

    def __init__(self, lora_config: LoRAConfig | None, shapes: LoRAModelShapes | None) -> None:
        self.lora_config = lora_config
        self.shapes = shapes
        # lora_int_id -> the request that first named it (every later one must equal it).
        self.bindings: dict[int, LoRARequest] = {}
        self._checked: OrderedDict[int, None] = OrderedDict()

    def check(self, lora_request: LoRARequest | None) -> LoRARequest | None:
        """Returns `lora_request` once it passed.

        Raises:
            ValueError: starting with "lora_request:": LoRA is off, it is not a LoRARequest,
                its id is bound to another adapter, or its adapter cannot be loaded (the
                reason from `load_peft_adapter`).
        """
        if lora_request is None:
            return None
        if self.lora_config is None:
            raise ValueError("lora_request: LoRA is not enabled in this engine (start it with "
                             "enable_lora=True / --enable-lora)")
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request: expected a LoRARequest, got "
                             f"{type(lora_request).__name__}")
        bound = self.bindings.get(lora_request.lora_int_id)
        if bound is not None and bound != lora_request:
            raise ValueError(f"lora_request: lora_int_id {lora_request.lora_int_id} is already "
                             f"used by adapter {bound.lora_name!r} at {bound.lora_path}; give "
                             f"each adapter its own id")
        if lora_request.lora_int_id in self._checked:
            self._checked.move_to_end(lora_request.lora_int_id)
            return lora_request
        try:
            load_peft_adapter(lora_request, self.shapes, self.lora_config.max_lora_rank)
        except ValueError as e:
            raise ValueError(f"lora_request: {e}") from None
        self.bindings[lora_request.lora_int_id] = lora_request
        self._checked[lora_request.lora_int_id] = None
        while len(self._checked) > self.lora_config.max_cpu_loras:
            self._checked.popitem(last=False)
        return lora_request

    def forget(self, lora_int_id: int) -> None:
        """Drop an id's binding (an unloaded adapter): the id may name another adapter later."""
        self.bindings.pop(lora_int_id, None)
        self._checked.pop(lora_int_id, None)
