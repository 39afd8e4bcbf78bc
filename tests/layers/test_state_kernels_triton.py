"""The recurrent layers' Triton kernels (layers/triton_state_ops.py) against the per-token float64
recurrences and the torch reference ops, on the mixed varlen batch of
tests/native/test_state_scan.py (fresh, continued, decode, stale-slot requests; grouped heads),
float32 and bfloat16 activations, a request split into chunks, and the states emitted at the
block boundaries inside a step (prefix-caching mode "align").

On a GPU the kernels run compiled on CUDA tensors; without one they run on CPU tensors in
triton's interpreter, imported with TRITON_INTERPRET=1 as tests/attention/test_triton_paged.py
does (and skipped when triton was already imported in this process without it). Tiny shapes:
the interpreter is slow.
"""

from __future__ import annotations

import importlib
import importlib.util

import pytest
import torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _import_kernels():
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed", allow_module_level=True)
    with pytest.MonkeyPatch.context() as mp:
        if DEVICE.type == "cpu":
            mp.setenv("TRITON_INTERPRET", "1")
        import triton
        from triton.runtime.interpreter import InterpretedFunction

        module = importlib.import_module("pagedllm.layers.triton_state_ops")
        if DEVICE.type == "cpu" and not (isinstance(triton.language.zeros, InterpretedFunction)
                                         and module.INTERPRETED):
            pytest.skip("triton was imported in this process before without TRITON_INTERPRET=1; "
                        "run this module in its own process", allow_module_level=True)
        # The first launch imports more of triton under the setting (see test_triton_paged).
        from tests.native.test_state_scan import _meta
        meta = _meta(dict(query_lens=[1], computed=[0], slots=[0]), DEVICE)
        module.causal_conv1d_varlen_triton(torch.zeros(1, 2, device=DEVICE),
                                           torch.zeros(2, 2, device=DEVICE), None,
                                           torch.zeros(1, 2, 1, device=DEVICE), meta)
    return module


KERNELS = _import_kernels()

from tests.native.test_state_scan import (STATE_CASE, _meta, check_emitted_states,  # noqa: E402
                                          float64_expected, make_inputs, run_backend)

# The shared case with shorter requests (the interpreter runs every token of every program).
CASE = dict(STATE_CASE, query_lens=[5, 3, 1, 1, 1], computed=[0, 5, 20, 0, 4], channels=40)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_ops_equal_recurrence_and_torch_reference(dtype):
    inputs = make_inputs(4, CASE, dtype=dtype)
    triton_out = run_backend("triton", inputs, _meta(CASE, DEVICE), dtype=dtype, device=DEVICE,
                             dt_limit=(0.0, 0.7))
    reference = run_backend("torch", inputs, _meta(CASE), dt_limit=(0.0, 0.7))
    for name in ("y", "ssm", "o", "delta", "conv"):
        torch.testing.assert_close(triton_out[name], reference[name], atol=3e-5, rtol=3e-5,
                                   msg=name)
    tol = 1e-2 if dtype == torch.bfloat16 else 2e-5
    torch.testing.assert_close(triton_out["conv_out"], reference["conv_out"], atol=tol, rtol=tol)
    if dtype == torch.float32:
        expected = float64_expected(inputs, CASE)
        for name in ("conv_out", "conv", "o", "delta"):   # dt unclamped there: not y / ssm
            torch.testing.assert_close(triton_out[name], expected[name], atol=3e-5, rtol=3e-5,
                                       msg=name)


def test_triton_chunk_split_equals_whole():
    case = dict(CASE, query_lens=[7], computed=[0], slots=[2])
    inputs = make_inputs(5, case)
    whole = run_backend("triton", inputs, _meta(case, DEVICE), device=DEVICE)
    state = {k: inputs[k].clone() for k in ("conv", "ssm", "delta")}
    outs: dict[str, list] = {"conv_out": [], "y": [], "o": []}
    start = 0
    for length in (3, 1, 3):
        part_case = dict(case, query_lens=[length], computed=[start])
        part = {k: (v[start:start + length] if v.shape[0] == 7 else v)
                for k, v in inputs.items()}
        part.update(state)
        got = run_backend("triton", part, _meta(part_case, DEVICE), device=DEVICE)
        for k in outs:
            outs[k].append(got[k])
        state = {k: got[k] for k in ("conv", "ssm", "delta")}
        start += length
    for k in outs:
        torch.testing.assert_close(torch.cat(outs[k]), whole[k], atol=1e-6, rtol=1e-6, msg=k)
    for k in ("conv", "ssm", "delta"):
        torch.testing.assert_close(state[k][2], whole[k][2], atol=1e-6, rtol=1e-6, msg=k)


def test_triton_ops_emit_block_boundary_states():
    check_emitted_states("triton", DEVICE, atol=3e-5)
