"""The native CPU kernel library (see `library.py` for how it is built and loaded, `abi.py` for
its entry points and structs, `ops.py`, `attention_ops.py` and `quantized_ops.py` for the Python wrappers)."""

from pagedllm.native.kernels.library import build_cpu_kernels, cpu_kernels

__all__ = ["build_cpu_kernels", "cpu_kernels"]
