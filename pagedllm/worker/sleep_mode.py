"""Sleep mode and in-place weight updates of one worker's model (vLLM's `sleep` / `wake_up` /
weight sync for RL; see docs/sleep_mode.md).

    sleep(1)    the KV cache is freed (by the runner); the weights move to host memory, or on
                the CPU, where they already are, stay as they are
    sleep(2)    the KV cache and the weights are freed; `wake_up` reloads the weights from the
                checkpoint this model last loaded (the engine's, or the last weight update's)
    wake_up()   the weights come back; the runner allocates an empty KV cache again
    stage(path) -> commit() | discard()
                a weight update in two phases: every tensor-parallel rank loads and checks its
                shard of the new checkpoint first (names, shapes, dtypes), and only when every
                rank agrees does any rank copy it in; a refused update changes nothing

Parameters keep their Python objects: only their storage is replaced or overwritten, so the
layers, quant methods and LoRA wrappers that hold them stay valid; buffers are replaced, never
written, as some are read-only tables shared between layers and models (RoPE's). Native structures that hold raw pointers into them (the CPU fused
decoder, the decode loop, CUDA graphs) are the runner's to rebuild after a change
(`ModelRunner.weights_changed`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from pagedllm.platforms import current_platform

# Loads a fresh model (weights processed as at start-up) from a checkpoint folder.
ModelLoader = Callable[[str], nn.Module]


@dataclass(frozen=True)
class TensorSlot:
    """Where one parameter or buffer of a model lives: `module.<attr>` (named `name`)."""

    name: str
    module: nn.Module
    attr: str
    is_parameter: bool

    @property
    def tensor(self) -> torch.Tensor:
        return getattr(self.module, self.attr)

    def assign(self, value: torch.Tensor) -> None:
        """Make the slot hold `value`: a parameter keeps its object and takes `value`'s
        storage; a buffer is replaced (buffers may be shared read-only tables, e.g. RoPE's
        across layers and models, which must never be written or freed in place)."""
        if self.is_parameter:
            self.tensor.data = value
        else:
            setattr(self.module, self.attr, value)


def tensor_slots(model: nn.Module) -> dict[str, TensorSlot]:
    """Every parameter and buffer slot of `model` by qualified name (a tensor tied to two
    modules, or shared by several, has a slot in each)."""
    slots: dict[str, TensorSlot] = {}
    for prefix, module in model.named_modules():
        dot = f"{prefix}." if prefix else ""
        for attr, _ in module.named_parameters(recurse=False):
            slots[dot + attr] = TensorSlot(dot + attr, module, attr, True)
        for attr, _ in module.named_buffers(recurse=False):
            slots[dot + attr] = TensorSlot(dot + attr, module, attr, False)
    return slots


def model_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of `model` by qualified name (see `tensor_slots`)."""
    return {name: slot.tensor for name, slot in tensor_slots(model).items()}


def tensor_bytes(tensors: dict[str, torch.Tensor]) -> int:
    """Bytes of the distinct tensors among `tensors` (tied and shared ones once)."""
    unique = {id(t): t for t in tensors.values()}
    return sum(t.numel() * t.element_size() for t in unique.values())


def incompatibilities(old: dict[str, torch.Tensor], new: dict[str, torch.Tensor],
                      limit: int = 6) -> list[str]:
    """Why `new` cannot replace `old` in place: names missing on either side and tensors whose
    shape or dtype differ (at most `limit` entries; empty: compatible)."""
    problems = [f"{name} missing from the new weights" for name in old if name not in new]
    problems += [f"{name} is not a tensor of the serving model" for name in new
                 if name not in old]
    for name, tensor in old.items():
        other = new.get(name)
        if other is not None and (other.shape != tensor.shape or other.dtype != tensor.dtype):
            problems.append(f"{name}: {tuple(other.shape)} {str(other.dtype)[6:]} != serving "
                            f"{tuple(tensor.shape)} {str(tensor.dtype)[6:]}")
    return problems[:limit] + ([f"... {len(problems) - limit} more"]
                               if len(problems) > limit else [])


def _empty_like(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(0, dtype=t.dtype, device=t.device)


class SleepMode:
    """A worker's sleep level, the host copies of its weights and a staged weight update.

    Args:
        weights_path: the checkpoint folder the model was loaded from (level 2 reloads it).
        load: builds a fresh model from a checkpoint folder (the worker's loader).
    """

    def __init__(self, weights_path: str, load: ModelLoader) -> None:
        self.weights_path = weights_path
        self._load = load
        self.level = 0
        # Level 1 off the CPU: the weights' host copies, by tensor name.
        self._host: dict[str, torch.Tensor] | None = None
        # Level 2: the freed tensors' shapes and dtypes (on the meta device), by name.
        self._freed: dict[str, torch.Tensor] = {}
        # A checked update waiting for commit: (path, its tensors by name).
        self._staged: tuple[str, dict[str, torch.Tensor]] | None = None

    def sleep(self, model: nn.Module, level: int) -> int:
        """Free `model`'s weights per `level` (1 or 2; the KV cache is the runner's); returns
        the bytes of weights freed on the device.

        Raises:
            ValueError: a level other than 1 or 2, or already asleep.
        """
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level!r}")
        if self.level:
            raise ValueError(f"already asleep (level {self.level}); wake_up first")
        self.discard()
        slots = tensor_slots(model)
        tensors = {name: slot.tensor for name, slot in slots.items()}
        freed = 0
        if level == 1 and next(iter(tensors.values())).device.type != "cpu":
            pin = torch.cuda.is_available()
            copies: dict[int, torch.Tensor] = {}   # id -> host copy (shared tensors once)
            for t in tensors.values():
                if id(t) not in copies:
                    host = t.data.to("cpu")
                    copies[id(t)] = host.pin_memory() if pin else host
            self._host = {name: copies[id(t)] for name, t in tensors.items()}
            freed = tensor_bytes(tensors)
            for name, slot in slots.items():
                slot.assign(_empty_like(tensors[name]))
        elif level == 2:
            freed = tensor_bytes(tensors)
            self._freed = {name: torch.empty(t.shape, dtype=t.dtype, device="meta")
                           for name, t in tensors.items()}
            for name, slot in slots.items():
                slot.assign(_empty_like(tensors[name]))
        self.level = level
        current_platform.release_freed_memory()
        return freed

    def wake_up(self, model: nn.Module) -> bool:
        """Bring the weights back (level 1: from the host copies; level 2: reloaded from
        `weights_path`); returns whether their storage changed (the runner then rebuilds what
        points into it). A no-op when awake.

        Raises:
            ValueError, FileNotFoundError: the checkpoint cannot be loaded again (the model
                stays asleep).
        """
        if not self.level:
            return False
        slots = tensor_slots(model)
        changed = True
        if self._host is not None:
            on_device: dict[int, torch.Tensor] = {}
            for name, slot in slots.items():
                host = self._host[name]
                if id(host) not in on_device:
                    on_device[id(host)] = host.to(slot.tensor.device)
                slot.assign(on_device[id(host)])
            self._host = None
        elif self.level == 2:
            fresh = model_tensors(self._load(self.weights_path))
            problems = incompatibilities(self._freed, fresh)
            if problems:
                raise ValueError(f"cannot reload {self.weights_path}: " + "; ".join(problems))
            for name, slot in slots.items():
                slot.assign(fresh[name].data if slot.is_parameter else fresh[name])
            self._freed = {}
        else:
            changed = False   # level 1 on the CPU: the weights never left
        self.level = 0
        return changed

    def stage(self, model: nn.Module, path: str) -> str | None:
        """Load the checkpoint at `path` and check it against `model`; kept for `commit`.

        Returns None when it fits, else why not (nothing is kept and `model` is untouched). It
        returns the refusal rather than raising so that a multi-process executor's other ranks
        learn of it without the engine treating it as a dead worker.
        """
        self.discard()
        if self.level:
            return f"the model is asleep (level {self.level}); wake_up first"
        try:
            fresh = model_tensors(self._load(path))
        except (ValueError, FileNotFoundError, OSError, KeyError) as e:
            return f"cannot load {path}: {e}"
        problems = incompatibilities(model_tensors(model), fresh)
        if problems:
            return (f"the weights of {path} do not fit the serving model: "
                    + "; ".join(problems))
        self._staged = (path, fresh)
        return None

    def commit(self, model: nn.Module) -> None:
        """Copy the staged weights into `model`'s tensors, in place (their storage, and so any
        pointer into it, stays).

        Raises:
            RuntimeError: nothing is staged.
        """
        if self._staged is None:
            raise RuntimeError("no weight update is staged (stage_weights first)")
        path, fresh = self._staged
        self._staged = None
        with torch.no_grad():
            for name, slot in tensor_slots(model).items():
                if slot.is_parameter:
                    slot.tensor.data.copy_(fresh[name].data)
                else:
                    slot.assign(fresh[name])
        self.weights_path = path
        del fresh
        current_platform.release_freed_memory()

    def discard(self) -> None:
        """Drop a staged update (if any)."""
        if self._staged is not None:
            self._staged = None
            current_platform.release_freed_memory()
