"""The recurrent layers' native CPU kernels (native/kernels/state_scan.py, csrc/cpu_state_scan.cpp)
against the per-token float64 recurrences of tests/layers/test_state_ops.py and the torch
reference ops, on a mixed varlen batch: a fresh prompt, a continued chunk, decodes, a fresh
one-token prompt over a stale slot, grouped heads (H_k < H, G < H) and a channel count that
spans two conv blocks; chunks split anywhere equal the whole; bfloat16 activations; and the
dispatcher (layers/state_kernels.py) choosing the kernels on the CPU; prefix-caching mode
"align": the states at the block boundaries inside a step, emitted into their entries' slots.

`STATE_CASE` and `run_backend` are shared with the Triton test (tests/layers/
test_state_kernels_triton.py).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedllm.attention.metadata import CommonAttentionMetadata
from pagedllm.layers import state_kernels
from pagedllm.layers.state_cache import StateCacheMetadata
from pagedllm.layers.gated_delta_ops import l2norm
from pagedllm.native.kernels import cpu_kernels
from tests.layers.test_state_ops import _delta_rule_reference, _metadata, _ssd_reference

F64 = torch.float64

# Requests: fresh 9-token prompt (slot 3), continued 6-token chunk (slot 1), decode (slot 2),
# fresh 1-token prompt over a stale slot (slot 4), continued decode (slot 5).
STATE_CASE = dict(query_lens=[9, 6, 1, 1, 1], computed=[0, 9, 20, 0, 4], slots=[3, 1, 2, 4, 5],
                  num_slots=6, channels=70, width=4, heads=4, head_dim=3, groups=2, state=5,
                  k_heads=2, dk=8, dv=6)


def make_inputs(seed: int, case: dict = STATE_CASE, dtype=F64) -> dict[str, torch.Tensor]:
    """Random inputs and states of `case` (float64; activations rounded through `dtype`)."""
    g = torch.Generator().manual_seed(seed)
    n = sum(case["query_lens"])
    s, c, k = case["num_slots"], case["channels"], case["width"]
    h, p, gr, ns = case["heads"], case["head_dim"], case["groups"], case["state"]
    hk, dk, dv = case["k_heads"], case["dk"], case["dv"]

    def randn(*shape, act=False):
        t = torch.randn(*shape, generator=g, dtype=F64)
        return t.to(dtype).to(F64) if act else t

    def rand(*shape):
        return torch.rand(*shape, generator=g, dtype=F64)

    return dict(x=randn(n, c, act=True), weight=randn(c, k), bias=randn(c),
                conv=randn(s, c, k - 1, act=True), xs=randn(n, h, p, act=True),
                dt=rand(n, h), a=-rand(h) * 2, d=randn(h), b=randn(n, gr, ns, act=True),
                c=randn(n, gr, ns, act=True), ssm=randn(s, h, p, ns), q=randn(n, hk, dk, act=True),
                k=randn(n, hk, dk, act=True), v=randn(n, h, dv, act=True), g=-rand(n, h) * 2,
                beta=rand(n, h), delta=randn(s, h, dk, dv))


def run_backend(backend: str, inputs: dict, meta, dtype=torch.float32, device="cpu",
                dt_limit=None) -> dict[str, torch.Tensor]:
    """The three ops through `state_kernels` with `backend`; outputs and final states float64."""
    act = {k: inputs[k].to(device, dtype) for k in ("x", "xs", "b", "c", "q", "k", "v")}
    f32 = {k: inputs[k].to(device, torch.float32)
           for k in ("weight", "bias", "dt", "a", "d", "ssm", "g", "beta", "delta")}
    conv = inputs["conv"].to(device, dtype)
    conv_out = state_kernels.causal_conv1d_varlen(act["x"], f32["weight"], f32["bias"], conv,
                                                  meta, backend=backend)
    y = state_kernels.ssd_varlen(act["xs"], f32["dt"], f32["a"], act["b"], act["c"], f32["d"],
                                 f32["ssm"], meta, 4, dt_limit, backend=backend)
    o = state_kernels.gated_delta_rule_varlen(act["q"], act["k"], act["v"], f32["g"],
                                              f32["beta"], f32["delta"], meta, 4,
                                              backend=backend)
    return {k: t.to("cpu", F64) for k, t in dict(conv_out=conv_out, conv=conv, y=y, ssm=f32["ssm"],
                                                 o=o, delta=f32["delta"]).items()}


def _meta(case: dict = STATE_CASE, device="cpu"):
    meta = _metadata(case["query_lens"], case["computed"], case["slots"])
    if device == "cpu":
        return meta
    return type(meta)(**{f: (getattr(meta, f).to(device) if torch.is_tensor(getattr(meta, f))
                             else getattr(meta, f)) for f in meta.__dataclass_fields__})


def float64_expected(inputs: dict, case: dict = STATE_CASE) -> dict[str, torch.Tensor]:
    """Each request alone through the per-token float64 recurrences."""
    x, conv0, ssm0, delta0 = inputs["x"], inputs["conv"], inputs["ssm"], inputs["delta"]
    weight, bias, k = inputs["weight"], inputs["bias"], case["width"]
    h, per = case["heads"], case["heads"] // case["k_heads"]
    gper = case["heads"] // case["groups"]
    out = dict(conv_out=torch.empty_like(x), conv=conv0.clone(), ssm=ssm0.clone(),
               delta=delta0.clone(), y=torch.empty_like(inputs["xs"]),
               o=torch.empty_like(inputs["v"]))
    start = 0
    for length, c0, slot in zip(case["query_lens"], case["computed"], case["slots"]):
        span = slice(start, start + length)
        start += length
        window = conv0[slot] if c0 else torch.zeros_like(conv0[slot])
        seq = torch.cat([window.t(), x[span]])
        out["conv_out"][span] = torch.stack([(seq[t:t + k] * weight.t()).sum(0) + bias
                                             for t in range(length)])
        out["conv"][slot] = seq[-(k - 1):].t()
        s0 = ssm0[slot] if c0 else torch.zeros_like(ssm0[slot])
        xs = inputs["xs"][span]
        ref, out["ssm"][slot] = _ssd_reference(
            xs, inputs["dt"][span], inputs["a"], inputs["b"][span].repeat_interleave(gper, 1),
            inputs["c"][span].repeat_interleave(gper, 1), s0)
        out["y"][span] = ref + inputs["d"][:, None] * xs
        d0 = delta0[slot] if c0 else torch.zeros_like(delta0[slot])
        q = (l2norm(inputs["q"][span]) * case["dk"] ** -0.5).repeat_interleave(per, 1)
        kk = l2norm(inputs["k"][span]).repeat_interleave(per, 1)
        ref, out["delta"][slot] = _delta_rule_reference(
            q.transpose(0, 1), kk.transpose(0, 1), inputs["v"][span].transpose(0, 1),
            inputs["g"][span].t(), inputs["beta"][span].t(), d0)
        out["o"][span] = ref.transpose(0, 1)
    assert h == out["o"].shape[1]
    return out


needs_kernels = pytest.mark.skipif(cpu_kernels() is None, reason="native CPU kernels not built")


@needs_kernels
def test_native_ops_equal_float64_recurrence_and_torch_reference():
    inputs = make_inputs(0)
    meta = _meta()
    native = run_backend("native", inputs, meta)
    expected = float64_expected(inputs)
    reference = run_backend("torch", inputs, meta)
    for name, want in expected.items():
        torch.testing.assert_close(native[name], want, atol=2e-5, rtol=2e-5, msg=name)
        torch.testing.assert_close(native[name], reference[name], atol=2e-5, rtol=2e-5, msg=name)


@needs_kernels
@pytest.mark.parametrize("dv", [32, 64, 128])
def test_native_register_forms_equal_float64_recurrence(dv):
    """The delta rule's forms for value heads of 32, 64 and 128 (kept in vector registers), and
    the conv over two full channel blocks and a tail, against the float64 recurrences."""
    case = dict(STATE_CASE, dv=dv, dk=16, channels=150)
    inputs = make_inputs(5, case)
    native = run_backend("native", inputs, _meta(case))
    for name, want in float64_expected(inputs, case).items():
        torch.testing.assert_close(native[name], want, atol=3e-5, rtol=3e-5, msg=name)


@needs_kernels
def test_conv_window_wider_than_the_kernel():
    """A conv window over CONV_MAX_WIDTH taps: the native op refuses it by name, and the
    dispatcher runs the torch reference instead."""
    from pagedllm.native.kernels import state_scan
    width = state_scan.CONV_MAX_WIDTH + 1
    case = dict(STATE_CASE, width=width)
    inputs = make_inputs(6, case)
    meta = _meta(case)
    x, weight = inputs["x"].float(), inputs["weight"].float()
    with pytest.raises(ValueError, match="conv window of 17 taps"):
        state_kernels.causal_conv1d_varlen(x, weight, None, inputs["conv"].float().clone(),
                                           meta, backend="native")
    got = state_kernels.causal_conv1d_varlen(x, weight, inputs["bias"].float(),
                                             inputs["conv"].float().clone(), meta)
    want = float64_expected(inputs, case)["conv_out"]
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=2e-5)


@needs_kernels
@pytest.mark.parametrize("dv", [6, 64])
def test_native_chunk_splits_equal_the_whole(dv):
    """One 23-token request run whole, then as chunks of 1, 4, 1, 1, 9 and 7 tokens carrying
    its states: the token-by-token scan gives the same bits, wherever the chunks split (value
    heads of 6: the general form; 64: the register form; one-token chunks, the first over no
    state, take the conv's decode form)."""
    whole_case = dict(STATE_CASE, query_lens=[23], computed=[0], slots=[2], dv=dv)
    inputs = make_inputs(1, whole_case)
    whole = run_backend("native", inputs, _meta(whole_case))
    state = {k: inputs[k].clone() for k in ("conv", "ssm", "delta")}
    outs: dict[str, list] = {"conv_out": [], "y": [], "o": []}
    start = 0
    for length in (1, 4, 1, 1, 9, 7):
        case = dict(whole_case, query_lens=[length], computed=[start])
        part = {k: (v[start:start + length] if k in ("x", "xs", "dt", "b", "c", "q", "k", "v", "g",
                                                      "beta") else v) for k, v in inputs.items()}
        part.update(state)
        got = run_backend("native", part, _meta(case))
        for k in outs:
            outs[k].append(got[k])
        state = {k: got[k] for k in ("conv", "ssm", "delta")}
        start += length
    for k in outs:
        assert torch.equal(torch.cat(outs[k]), whole[k]), k
    for k in ("conv", "ssm", "delta"):
        assert torch.equal(state[k][2], whole[k][2]), k


@needs_kernels
def test_native_bfloat16_activations():
    """bfloat16 activations are read as bfloat16 and computed in float32: the scans equal the
    float32 reference on the same (rounded) values; the conv output is rounded to bfloat16."""
    inputs = make_inputs(2, dtype=torch.bfloat16)
    meta = _meta()
    native = run_backend("native", inputs, meta, dtype=torch.bfloat16, dt_limit=(0.0, 0.6))
    reference = run_backend("torch", inputs, meta, dtype=torch.float32, dt_limit=(0.0, 0.6))
    for name in ("y", "ssm", "o", "delta", "conv"):
        torch.testing.assert_close(native[name], reference[name], atol=2e-5, rtol=2e-5, msg=name)
    torch.testing.assert_close(native["conv_out"], reference["conv_out"], atol=1e-2, rtol=1e-2)


@needs_kernels
@pytest.mark.parametrize("width", [2, 3, 4, 5])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_conv_decode_form_equals_float64_recurrence(width, state_dtype):
    """The conv's decode form (one-token queries of 2-4 taps: the window read and shifted in
    the slot in place; AVX-512: 16 channels a vector for 4 taps) on float32 inputs with the
    window state in float32 or bfloat16 (the Gated DeltaNet block's case: float32 activations,
    the window in the model dtype), 150 channels (two full channel blocks and a tail of 22 =
    16 + 6), with and without an initial window and bias, SiLU fused: output and new window
    against the float64 recurrence on the same (rounded) window. Width 5 runs the general
    form, the same check."""
    case = dict(STATE_CASE, query_lens=[1, 1, 1, 1], computed=[3, 0, 7, 1], slots=[4, 1, 2, 5],
                channels=150, width=width)
    inputs = make_inputs(11, case)
    inputs["conv"] = inputs["conv"].to(state_dtype).to(F64)
    meta = _meta(case)
    for bias in (inputs["bias"], None):
        conv = inputs["conv"].to(state_dtype)
        got = state_kernels.causal_conv1d_varlen(inputs["x"].float(), inputs["weight"].float(),
                                                 None if bias is None else bias.float(), conv,
                                                 meta, "silu", backend="native")
        want = float64_expected(dict(inputs, bias=torch.zeros_like(inputs["bias"])
                                     if bias is None else bias), case)
        torch.testing.assert_close(got.double(), torch.nn.functional.silu(want["conv_out"]),
                                   atol=2e-5, rtol=2e-5)
        # The new window: the old one's last inputs (exact) and the token's input, rounded to
        # the state dtype; untouched slots keep their bits.
        torch.testing.assert_close(conv.double(), want["conv"].to(state_dtype).double(),
                                   atol=0, rtol=0)


@needs_kernels
def test_dispatch_and_bad_input():
    inputs = make_inputs(3)
    meta = _meta()
    x = inputs["x"].float()
    assert state_kernels.pick_backend(None, x) == "native"
    assert state_kernels.pick_backend(None, x.double()) == "torch"
    with pytest.raises(ValueError, match="unknown state-op backend"):
        state_kernels.pick_backend("cuda-magic", x)
    with pytest.raises(ValueError, match="unknown activation"):
        state_kernels.causal_conv1d_varlen(x, inputs["weight"].float(), None,
                                           inputs["conv"].float(), meta, activation="gelu")
    small = inputs["conv"].float()[:3]     # slots 3, 4, 5 out of range
    with pytest.raises(ValueError, match="out of range"):
        state_kernels.causal_conv1d_varlen(x, inputs["weight"].float(), None, small, meta,
                                           backend="native")
    silu = state_kernels.causal_conv1d_varlen(x, inputs["weight"].float(), None,
                                              inputs["conv"].float().clone(), meta, "silu")
    plain = state_kernels.causal_conv1d_varlen(x, inputs["weight"].float(), None,
                                               inputs["conv"].float().clone(), meta,
                                               backend="torch")
    torch.testing.assert_close(silu, torch.nn.functional.silu(plain), atol=1e-5, rtol=1e-5)


# Mode "align", blocks of 4: a fresh 10-token prompt (entries 0, 1 emitted inside the step into
# slots 1, 2; it ends in slot 3), a chunk over tokens 6 .. 12 (reads entry 1, slot 4, copied to
# its write slot 6; emits entry 2 into slot 5), a fresh 9-token prompt whose entry 0 is null (no
# slot: skipped) and entry 1 emitted into slot 7, and a decode that crosses into entry 2.
EMIT_CASE = dict(STATE_CASE, query_lens=[10, 7, 9, 1], computed=[0, 6, 0, 8],
                 slots=[3, 6, 8, 10], num_slots=11, channels=40)
EMIT_TABLE = [[1, 2, 3, 0], [0, 4, 5, 6], [0, 7, 8, 0], [0, 9, 10, 0]]
EMIT_BLOCK = 4
# (request, token index in its query, slot) of each emit the metadata must list.
EMITS = [(0, 3, 1), (0, 7, 2), (1, 5, 5), (2, 3, 0), (2, 7, 7)]


def emit_meta(device="cpu") -> StateCacheMetadata:
    """EMIT_CASE's mode-"align" metadata (block table EMIT_TABLE)."""
    query_lens, computed = np.array(EMIT_CASE["query_lens"]), np.array(EMIT_CASE["computed"])
    qsl = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
    seq_lens = (computed + query_lens).astype(np.int32)
    common = CommonAttentionMetadata(
        query_start_loc=torch.from_numpy(qsl).to(device), query_start_loc_cpu=qsl,
        seq_lens=torch.from_numpy(seq_lens).to(device), seq_lens_cpu=seq_lens,
        block_table=torch.tensor(EMIT_TABLE, dtype=torch.int32, device=device),
        slot_mapping=torch.zeros(int(qsl[-1]), dtype=torch.int64, device=device),
        num_reqs=len(query_lens), num_actual_tokens=int(qsl[-1]),
        max_query_len=int(query_lens.max()), max_seq_len=int(seq_lens.max()),
        block_size=EMIT_BLOCK)
    return StateCacheMetadata.from_common(common, align=True)


def check_emitted_states(backend: str, device="cpu", atol=2e-5) -> None:
    """`backend` on EMIT_CASE: outputs and final states equal the float64 recurrences, each
    emitted slot holds its request's state after its token, the null slot 0 is untouched."""
    meta = emit_meta(device)
    got_emits = list(zip(np.repeat(np.arange(4), np.diff(meta.emit_start_cpu)),
                         meta.emit_offset.tolist(), meta.emit_slot.tolist()))
    assert got_emits == EMITS
    assert meta.copy_src.tolist() == [4, 9] and meta.copy_dst.tolist() == [6, 10]
    inputs = make_inputs(6, EMIT_CASE)
    for name in ("conv", "ssm", "delta"):          # the runner's copies before the step
        inputs[name][meta.copy_dst.cpu()] = inputs[name][meta.copy_src.cpu()]
    got = run_backend(backend, inputs, meta, device=device)
    expected = float64_expected(inputs, EMIT_CASE)
    final = EMIT_CASE["slots"]
    for name, want in expected.items():
        rows = final if name in ("conv", "ssm", "delta") else slice(None)
        torch.testing.assert_close(got[name][rows], want[rows], atol=atol, rtol=atol, msg=name)
    starts = np.concatenate([[0], np.cumsum(EMIT_CASE["query_lens"])])
    for req, offset, slot in EMITS:
        if slot == 0:
            continue
        # The request alone, its query cut after the emitted token: its final state.
        case = dict(EMIT_CASE, query_lens=[offset + 1], computed=[EMIT_CASE["computed"][req]],
                    slots=[EMIT_CASE["slots"][req]])
        part = {k: (v[starts[req]:starts[req] + offset + 1]
                    if v.shape[0] == starts[-1] and k not in ("weight", "bias") else v)
                for k, v in inputs.items()}
        want = float64_expected(part, case)
        for name in ("conv", "ssm", "delta"):
            torch.testing.assert_close(got[name][slot], want[name][case["slots"][0]], atol=atol,
                                       rtol=atol, msg=f"{name} emitted into slot {slot}")
    for name in ("conv", "ssm", "delta"):
        assert torch.equal(got[name][0], inputs[name][0].float().double()), name


def test_reference_ops_emit_block_boundary_states():
    check_emitted_states("torch")


@needs_kernels
def test_native_ops_emit_block_boundary_states():
    check_emitted_states("native")
