"""Platform interface: everything that differs between device kinds lives behind this object.

The rest of the engine asks `current_platform` for the device, the default dtype, memory figures and
the attention backend; it never checks `torch.cuda` itself.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Mapping

import torch

from pagedllm.envs import EnvOptions, unknown_variables

logger = logging.getLogger(__name__)


class Platform(ABC):
    """One kind of device (CPU, CUDA, or one a plugin registers: `platforms/plugins.py`)."""

    device_type: str = ""
    # torch.distributed backend for tensor/pipeline-parallel groups on this device kind.
    dist_backend: str = "gloo"
    # multiprocessing start method of the `mp` executor's worker processes.
    worker_multiproc_method: str = "forkserver"
    # Ray resource one rank reserves in the `ray` executor's placement group.
    ray_resource_key: str = "CPU"
    # A KV cache sized by a memory fraction stops at what max_num_seqs full-length requests can
    # use (CPU: the cache shares RAM with everything else; a 10M-parameter model needs megabytes,
    # not the 4 GiB default cap). Devices with dedicated memory keep the whole fraction, whose
    # surplus serves as prefix cache.
    cap_kv_cache_at_need: bool = False
    # Whether the KV budget depends on the memory peak of the profile run (CUDA: the largest
    # batch's activations stay reserved by the caching allocator). Where it does not (CPU: the
    # budget is a share of free RAM capped at a few GiB, and a freed activation buffer goes back
    # to the allocator or the OS), the profile run is a short warm-up batch instead of the
    # largest one: a 8192-token dummy prefill was most of a small GGUF model's start-up time
    # (docs/benchmarks.md, "Measurements behind choices in the code").
    profile_run_at_max_batch: bool = True
    # The PAGEDLLM_* settings (`options`); None until first read.
    _options: EnvOptions | None = None

    @property
    def options(self) -> EnvOptions:
        """The `PAGEDLLM_*` settings (pagedllm/envs.py) as read at the last engine start
        (`configure_options`); read from the environment on first use if none started yet.

        Raises:
            ValueError: on that first read, for a variable whose value is refused.
        """
        if self._options is None:
            self._options = EnvOptions.from_environ()
        return self._options

    def configure_options(self, environ: Mapping[str, str] | None = None) -> EnvOptions:
        """Read every `PAGEDLLM_*` variable of `environ` (default `os.environ`) again into
        `options`: called when an engine starts, and in each worker process as it starts; a
        `PAGEDLLM_*` name set but not registered (a typo) is logged as a warning.

        Raises:
            ValueError: for a variable whose value is refused (`options` is left as it was).
        """
        self._options = EnvOptions.from_environ(environ)
        for name in unknown_variables(environ):
            logger.warning("unknown environment variable %s (ignored; the known ones are listed "
                           "in docs/environment.md)", name)
        return self._options

    @property
    def device(self) -> torch.device:
        return torch.device(self.device_type)

    @abstractmethod
    def preferred_dtype(self) -> torch.dtype:
        """Dtype used for dtype='auto'."""

    @abstractmethod
    def supported_dtypes(self) -> tuple[torch.dtype, ...]:
        """Dtypes the platform can run the model in."""

    @abstractmethod
    def mem_get_info(self) -> tuple[int, int]:
        """(free, total) memory in bytes available to the engine."""

    def init_device(self, local_rank: int = 0, local_world_size: int = 1,
                    threads_bind: str = "auto", reserved_cores: int | None = 0) -> None:
        """Prepare the device for this process (threads, current device).

        `local_rank` of `local_world_size` worker processes sharing this machine;
        `threads_bind` and `reserved_cores` place a CPU platform's threads (ParallelConfig's
        cpu_threads_bind, cpu_reserved_cores); other platforms ignore them.
        """

    # Where this process computes, in a few words for the layout summary ("" where nothing
    # was chosen; the CPU platform: its threads and cores).
    placement: str = ""

    def before_step(self) -> None:
        """Called by the worker before each model step (no-op here; see `after_step`)."""

    def after_step(self) -> None:
        """Called by the worker after each model step, on the thread that runs the model (the
        CPU platform fits its thread count to the cores it gets; no-op here)."""

    def bind_front_end(self, reserved_cores: int | None) -> None:
        """Move the calling thread (the API server's) to the cores kept from the kernels, where
        the platform keeps any (no-op here)."""

    @abstractmethod
    def kv_cache_budget_bytes(self, memory_utilization: float) -> int:
        """Bytes the KV cache may take, measured after the model is loaded and profiled."""

    def synchronize(self) -> None:
        """Wait for queued device work (no-op where execution is synchronous)."""

    def peak_memory_bytes(self) -> int:
        """Peak memory allocated on the device since start (0 if unknown)."""
        return 0

    def release_freed_memory(self) -> None:
        """Hand memory of freed tensors back to the system (sleep mode: worker/sleep_mode.py)
        where the allocator keeps it cached (no-op here)."""

    def attention_backend_name(self) -> str:
        """Name of the attention backend to use on this platform."""
        return "torch_sdpa"

    def get_attention_backend_cls(self) -> type | None:
        """An attention backend class this platform brings itself (a plugin's own kernels), or
        None. The selector (`attention/backends/selector.py`) registers it under its `name` next to the
        built-in backends before it looks up `attention_backend_name()`; it must provide what
        `TorchSDPABackend` does (`name`, `build_metadata`, `forward`, ...)."""
        return None

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """y = x @ weight^T + bias for the model's linear layers ([..., K] x [N, K] -> [..., N]),
        in `out_dtype` (default x's dtype; the LM head asks for float32 logits); platforms with a
        faster kernel for some shapes override this."""
        y = torch.nn.functional.linear(x, weight, bias)
        return y if out_dtype is None else y.to(out_dtype)

    def pack_linear_weight(self, weight: torch.Tensor) -> torch.Tensor | None:
        """A loaded linear weight [N, K] rearranged for this platform's packed GEMM (same shape,
        dtype and element count), or None to keep it as it is (the default: no packed GEMM).
        A weight returned here is only read through `packed_linear`."""
        return None

    def packed_linear(self, x: torch.Tensor, packed_weight: torch.Tensor,
                      bias: torch.Tensor | None = None) -> torch.Tensor:
        """y = x @ W^T + bias for a weight from `pack_linear_weight`; [..., N] in x's dtype.

        Raises:
            NotImplementedError: on a platform that never packs.
        """
        raise NotImplementedError(f"{type(self).__name__} has no packed GEMM")

    def unpack_linear_weight(self, packed_weight: torch.Tensor) -> torch.Tensor:
        """The [N, K] row-major weight back from `pack_linear_weight`'s output.

        Raises:
            NotImplementedError: on a platform that never packs.
        """
        raise NotImplementedError(f"{type(self).__name__} has no packed GEMM")

    def packed_embedding(self, packed_weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` ([...] int64 in [0, N)) of a weight from `pack_linear_weight`, as
        [..., K] in its dtype: the lookup of an embedding whose tied LM head packed it.

        Raises:
            NotImplementedError: on a platform that never packs.
        """
        raise NotImplementedError(f"{type(self).__name__} has no packed GEMM")

    def fused_decoder_max_tokens(self, dtype: torch.dtype, packed_weights: bool = False) -> int:
        """Most tokens of a step that the fused decoder path (`native/fused_decoder.py`) takes
        for a model of `dtype` (`packed_weights`: its linear weights went through
        `pack_linear_weight`); 0: never (the platform has no such kernel)."""
        return 0

    def seed_everything(self, seed: int) -> None:
        torch.manual_seed(seed)

    def resolve_dtype(self, name: str) -> torch.dtype:
        """Map a config dtype name to a torch dtype, "auto" to the preferred one.

        Raises:
            ValueError: if the platform cannot run that dtype.
        """
        dtype = self.preferred_dtype() if name == "auto" else getattr(torch, name)
        if dtype not in self.supported_dtypes():
            raise ValueError(f"dtype {name} is not supported on {self.device_type}; supported: "
                             f"{[str(d).removeprefix('torch.') for d in self.supported_dtypes()]}")
        return dtype
