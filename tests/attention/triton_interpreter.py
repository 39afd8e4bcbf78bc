"""Import Triton kernel modules for tests: compiled on a GPU, in triton's interpreter without one.

The interpreter is chosen when `@triton.jit` decorates a function, and triton's own library
(`tl.sum`, `tl.zeros`, ...) is decorated when triton is imported: so without a GPU the kernel
modules (and triton, if not imported yet) are imported with TRITON_INTERPRET=1, and the
environment is restored right after (nothing leaks into other tests or the subprocesses they
start). If triton was already imported in this process without the interpreter, the calling test
module is skipped.
"""

from __future__ import annotations

import importlib
import importlib.util

import pytest
import torch


def import_triton_kernels(names: tuple[str, ...], device: torch.device) -> dict:
    """{name: module} of `pagedllm.attention.ops.<name>` for each name, interpreted on a CPU
    `device`; skips the calling test module where that cannot be had."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed", allow_module_level=True)
    with pytest.MonkeyPatch.context() as mp:
        if device.type == "cpu":
            mp.setenv("TRITON_INTERPRET", "1")
        import triton
        from triton.runtime.interpreter import InterpretedFunction

        modules = {n: importlib.import_module(f"pagedllm.attention.ops.{n}") for n in names}
        # NOTE: the first launch imports more of triton (triton.experimental.gluon, which checks
        # the interpreter setting on import); one tiny launch here does it under the setting.
        cache = torch.zeros(1, 1, 1, 1, device=device)
        importlib.import_module("pagedllm.attention.ops.triton_reshape_and_cache") \
            .reshape_and_cache(cache[0], cache[0], cache, cache,
                               torch.zeros(1, dtype=torch.int64, device=device))
    if device.type == "cpu" and not (isinstance(triton.language.zeros, InterpretedFunction)
                                     and all(m.INTERPRETED for m in modules.values())):
        pytest.skip("triton was imported in this process before without TRITON_INTERPRET=1; run "
                    "this module in its own process", allow_module_level=True)
    return modules
