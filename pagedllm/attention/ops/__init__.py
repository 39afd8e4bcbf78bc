"""Triton kernels of the `triton_paged` and `mla_triton` attention backends.

These modules import `triton` at import time; only `attention/backends/triton_paged.py` and
`attention/backends/mla_triton.py` import them, and only when they run, so the engine works where triton is not installed. Whether a kernel
runs compiled (CUDA) or in triton's interpreter (`TRITON_INTERPRET=1`, CPU tensors) is decided
when it is decorated: `@triton.jit` reads the variable then, for triton's own library
(`tl.sum`, `tl.zeros`, ...) when triton is imported, for these kernels when their module is.
"""
