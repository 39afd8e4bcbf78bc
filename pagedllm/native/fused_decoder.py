"""The CPU fused decoder path of the Llama family: all decoder layers of a step in one native call.

For steps of few tokens (decode, speculative verification, short prefill continuations) a layer
run module by module is ~25 torch operations and five native calls, each paying Python dispatch
and an OpenMP fork/join; at batch 1 that overhead exceeded the time spent streaming the weights.
`decoder_layers` in `pagedllm/native/kernels/csrc/cpu_decoder.cpp` runs each layer as one parallel
region instead (see its header for the math, which is the module path's). Linear layers kept
as GGUF blocks (`layers/quantization/gguf.py`) go in as their quant method's row segments
(`kernel_segments`: GGML type + bytes per segment) and run on the block kernels of
`csrc/cpu_gguf_linear.cpp` inside the same parallel region (or, when the method rounds
activations to 8 bits, `quantize_activations`, those of `csrc/cpu_gguf_q8_linear.cpp`); int8 /
W8A8 linear layers (`layers/quantization/int8.py`) go in as their int8 weight and per-row
scales (`kernel_weight`) and run on the kernels of `csrc/int8_blocks.h`, the module path's `ops.int8_linear`'s.

`FusedDecoder.applies(...)` decides per step; the module path (`llama.py`) remains the reference
and runs everything else: long fresh prefills (torch's flash attention is faster there), tensor
parallelism (the row-parallel all-reduce sits between the native phases), other KV/weight dtypes,
and `PAGEDLLM_CPU_FUSED_DECODER=0`. Tests compare both paths.

LoRA adapters (lora/layers.py) are applied inside the layers when attached (`attach_lora`):
after each linear the step's adapter tokens get their slot's x A^T B^T, grouped by slot
(`csrc/lora_kernel.h`), so a step with adapter tokens stays on this path and in the native
decode loop.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence

import torch

from pagedllm.attention.backends.cpu_paged import CpuPagedMetadata
from pagedllm.native.kernels import abi, cpu_kernels
from pagedllm.native.kernels.lora import LoRALinearWeights, NativeLoRAStep
from pagedllm.native.kernels.quantized_ops import gguf_segment_structs
from pagedllm.platforms import current_platform

_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}


DecoderLayerWeights = abi.struct("DecoderLayerWeights")
DecoderStep = abi.struct("DecoderStep")


def fused_decoder_enabled() -> bool:
    """False when `PAGEDLLM_CPU_FUSED_DECODER` is 0/false/off/no (the module path runs)."""
    return current_platform.options.cpu_fused_decoder


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _linears(layer) -> tuple:
    """The four linear layers of a decoder layer, in the native order (qkv, o, gate_up, down)."""
    return (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
            layer.mlp.down_proj)


def _is_quantized(linear) -> bool:
    return getattr(getattr(linear, "quant_method", None), "quantized", False)


def _is_packed(linear) -> bool:
    """Whether a float linear's weight holds the packed GEMM layout (the platform packed it at
    load, layers/quantization/base.py)."""
    return getattr(getattr(linear, "quant_method", None), "packed", False)


def _native_quantized(linear) -> bool:
    """Whether a quantized linear's method exposes what the native layer reads: GGUF row
    segments (`kernel_segments`) or an int8 weight with per-row scales (`kernel_weight`)."""
    method = linear.quant_method
    return hasattr(method, "kernel_segments") or hasattr(method, "kernel_weight")


class FusedDecoder:
    """Runs the decoder layers `layers` (LlamaDecoderLayer modules of one pipeline stage) through
    `decoder_layers`. Built once per model; the per-layer structures are built on the first call
    and rebuilt whenever a layer's KV cache tensor has been replaced since.

    Raises (from a call):
        ValueError: if a weight or the KV cache is not contiguous, or the block table is not
            int32 with unit column stride.
    """

    MAX_SCRATCH_BYTES = 256 << 20  # larger steps run the module path
    # Over long fresh prompts in a large step the module path can win: torch's flash attention
    # there (for a request whose whole sequence is new) against the paged kernel's tiles: the
    # fused path is ahead over prompts up to 1024 tokens and level over 2048
    # (docs/benchmarks.md, "Measurements behind choices in the code").
    LONG_STEP_TOKENS = 512
    LONG_FRESH_PROMPT_TOKENS = 1024

    def __init__(self, layers) -> None:
        self.layers = list(layers)
        # The layers' Attention modules, listed once (module attribute lookups are slow).
        self.attention = [layer.self_attn.attn for layer in self.layers]
        # The linears it was built from, kept: a wrapper later put around them (LoRA's, see
        # lora/layers.py) must not hide their weights from `_build`.
        self._linears = [_linears(layer) for layer in self.layers]
        first = self.layers[0]
        attn = first.self_attn
        # The model dtype: the norms', residual stream's and KV cache's (linear weights may be
        # GGUF blocks instead).
        self.dtype = first.input_layernorm.weight.dtype
        self.hidden_size = first.input_layernorm.weight.shape[0]
        self.q_size, self.kv_size = attn.q_size, attn.kv_size
        self.head_size = attn.head_size
        self.intermediate_size = first.mlp.down_proj.input_size_per_partition
        # The smallest sliding window of the layers (Mistral, Qwen2/3), None for none: steps
        # with a sequence longer than it run the module path (see `applies`).
        windows = [layer.self_attn.attn.sliding_window for layer in self.layers]
        self.min_window = min((w for w in windows if w is not None), default=None)
        # float32 scratch per token: normed, qkv, attention output, gate_up, act (+ the output).
        self._scratch_sizes = (self.hidden_size, self.q_size + 2 * self.kv_size, self.q_size,
                               2 * self.intermediate_size, self.intermediate_size)
        self._max_tokens = self.MAX_SCRATCH_BYTES // (4 * (sum(self._scratch_sizes)
                                                           + self.hidden_size))
        # All float linear weights in the packed GEMM layout: the platform may then take
        # larger steps (`fused_decoder_max_tokens`).
        linears = [m for layer in self.layers for m in _linears(layer)]
        self.packed_weights = all(_is_packed(m) for m in linears if not _is_quantized(m))
        self._structs: ctypes.Array | None = None
        # The steps' float32 scratch, kept and grown to the largest step (at most
        # MAX_SCRATCH_BYTES): a fresh 80 MB buffer per 2048-token step (llama-134m) paid its
        # page faults and the kernel's zeroing of its pages every step (docs/benchmarks.md,
        # "Measurements behind choices in the code").
        self._scratch = torch.empty(0, dtype=torch.float32)
        self._keepalive: list[torch.Tensor | ctypes.Array] = []
        # The KV caches the structures point into, held so their memory cannot be reused while
        # pointed at; a layer bound to another cache (the profiling run's caches are replaced by
        # the real ones) makes the next call rebuild.
        self._caches: list[torch.Tensor] = []
        # LoRA (`attach_lora`): per layer its four linears' slots, and the step's adapter
        # tokens (None: no adapter token in the step).
        self._lora_layers: list[ctypes.Array] | None = None
        self._lora_step: Callable[[], NativeLoRAStep | None] | None = None

    def attach_lora(self, layer_weights: Sequence[Sequence[LoRALinearWeights]],
                    step: Callable[[], NativeLoRAStep | None]) -> None:
        """Apply adapters inside the layers from now on.

        Args:
            layer_weights: per layer, its qkv, o, gate_up and down linears' adapter slots
                (`native.kernels.lora.lora_linear_weights`; their tensors outlive this).
            step: returns the current step's adapter tokens, or None when it has none; read at
                every call (and every native decode round).

        Raises:
            ValueError: not one entry of four per layer.
        """
        if len(layer_weights) != len(self.layers) or any(len(w) != 4 for w in layer_weights):
            raise ValueError(f"fused decoder: LoRA slots for {len(layer_weights)} layers, "
                             f"expected four linears for each of {len(self.layers)}")
        self._lora_layers = [(LoRALinearWeights * 4)(*w) for w in layer_weights]
        self._lora_step = step
        self.forget_structures()

    def lora_step(self) -> NativeLoRAStep | None:
        """The current step's adapter tokens (None: none, or no adapters attached)."""
        return None if self._lora_step is None else self._lora_step()

    @staticmethod
    def supports(layers) -> bool:
        """Whether these layers can ever take the fused path (checked once per model)."""
        if not layers or cpu_kernels() is None or not fused_decoder_enabled():
            return False
        first = layers[0]
        attn = first.self_attn
        weight = first.input_layernorm.weight
        norms = [m.weight for layer in layers for m in (layer.input_layernorm,
                 layer.post_attention_layernorm, layer.self_attn.q_norm, layer.self_attn.k_norm)
                 if m is not None]
        # NOTE(fused): the native layer attends over the whole causal context without capping;
        # layers with soft-capped logits (Gemma) run the module path. Layers with a sliding
        # window are taken: a window hides nothing from a sequence no longer than it, so
        # `applies` sends only steps with a longer sequence to the module path (a window >=
        # max_model_len never does, keeping the fused path whole for such models).
        plain_attention = all(layer.self_attn.attn.logits_soft_cap is None for layer in layers)
        # NOTE(fused): the native layer reads float [out, in] weights in the model dtype, GGUF
        # blocks through the quant method's `kernel_segments` (layers/quantization/gguf.py), or
        # int8 weights through its `kernel_weight` (layers/quantization/int8.py); other
        # quantized layers run the module path.
        linears = [m for layer in layers for m in _linears(layer)]
        weights_ok = all(_native_quantized(m) if _is_quantized(m)
                         else m.weight.dtype == weight.dtype for m in linears)
        return (plain_attention and weights_ok and weight.device.type == "cpu"
                and weight.dtype in _DTYPE_CODES
                and all(w.dtype == weight.dtype for w in norms)
                and attn.qkv_proj.tp_size == 1 and attn.head_size % 2 == 0
                # NOTE(fused): the native RoPE rotates whole heads (no partial_rotary_factor).
                and all(layer.self_attn.rotary_emb.rotary_dim == attn.head_size
                        for layer in layers)
                and all(size % 8 == 0 for size in (first.input_layernorm.weight.shape[0],
                                                   attn.q_size,
                                                   first.mlp.down_proj.input_size_per_partition)))

    def applies(self, num_tokens: int, metadata) -> bool:
        """Whether this step takes the fused path: the `cpu_paged` attention backend, no padded
        tokens, no `attend_until` (bidirectional image tokens), the KV cache in the weights'
        dtype, at most the platform's `fused_decoder_max_tokens` (and MAX_SCRATCH_BYTES of
        scratch), and not a large step
        with a long fresh prompt (see LONG_STEP_TOKENS), and no sequence longer than the
        layers' smallest sliding window (the native attention has no window). A model with
        several KV cache groups gets a `KVCacheGroupsMetadata` (one block table per group; the
        native call takes one), so it never takes this path; a single sliding group's blocks
        are all still held while every sequence fits the window. In the batch-invariant mode
        the answer is the same for every step (see `takes`)."""
        if not (isinstance(metadata, CpuPagedMetadata)
                and metadata.common.num_actual_tokens == num_tokens
                and metadata.common.attend_until is None):   # (its layers attend causally)
            return False
        batch_invariant = metadata.common.batch_invariant
        if not self.takes(num_tokens, int(metadata.seq_lens.max(initial=0)), batch_invariant):
            return False
        return batch_invariant or num_tokens <= self.LONG_STEP_TOKENS or all(
            end - start <= self.LONG_FRESH_PROMPT_TOKENS for start, end in metadata.fresh_rows)

    def takes(self, num_tokens: int, max_seq_len: int, batch_invariant: bool = False) -> bool:
        """The conditions of `applies` on the step's size alone: the KV cache in the weights'
        dtype, at most `max_step_tokens` tokens, no sequence (of up to `max_seq_len` tokens)
        longer than the smallest sliding window.

        With `batch_invariant` the path may not depend on the step (the module path rounds
        its activations elsewhere): every step of a model without sliding-window layers is
        taken, whatever its size (the scratch grows to the largest step, unbounded by
        MAX_SCRATCH_BYTES), and none of a model with them."""
        kv_cache = self.attention[0].kv_cache
        if not (kv_cache.dtype == self.dtype and kv_cache.dim() == 5):
            return False
        lora = self.lora_step()
        if lora is not None and lora.batch_tokens != num_tokens:
            return False   # adapter rows mapped for another batch (a round's other steps)
        if batch_invariant:
            return self.min_window is None
        return (num_tokens <= self.max_step_tokens()
                and (self.min_window is None or max_seq_len <= self.min_window))

    def _build(self) -> ctypes.Array:
        structs = (DecoderLayerWeights * len(self.layers))()
        keep: list[torch.Tensor] = []
        keep_structs: list[ctypes.Array] = []   # GGUF segment tables pointed at by `structs`

        def weight_ptr(linear) -> int | None:
            """A float or int8 linear's weight pointer; None for GGUF blocks (read via
            `segments`)."""
            method = linear.quant_method
            if not _is_quantized(linear):
                return linear.weight.data_ptr()
            if hasattr(method, "kernel_weight"):
                return method.kernel_weight(linear).qweight.data_ptr()
            return None

        def f32(t: torch.Tensor | None) -> int | None:
            """A float32 copy kept alive with the structures (biases, RoPE tables)."""
            if t is None:
                return None
            keep.append(t.detach().to(torch.float32).contiguous())
            return keep[-1].data_ptr()

        for s, layer, linears in zip(structs, self.layers, self._linears):
            attn = layer.self_attn
            rope = attn.rotary_emb
            cache = attn.attn.kv_cache
            for t in [m.weight for m in linears if not _is_quantized(m)] + [cache]:
                if not t.is_contiguous():
                    raise ValueError("fused decoder: weights and KV cache must be contiguous")
            for i, linear in enumerate(linears):
                if _is_quantized(linear) and hasattr(linear.quant_method, "kernel_weight"):
                    int8_weight = linear.quant_method.kernel_weight(linear)
                    keep += [int8_weight.qweight, int8_weight.scale]
                    s.int8_scales[i] = int8_weight.scale.data_ptr()
                    s.int8_activations[i] = int(int8_weight.quantize_activations)
                elif _is_quantized(linear):
                    segments = gguf_segment_structs(linear.quant_method.kernel_segments(linear),
                                                    linear.input_size_per_partition)
                    keep_structs.append(segments)
                    s.segments[i] = ctypes.addressof(segments)
                    s.num_segments[i] = len(segments)
                    s.gguf_q8_activations[i] = int(getattr(linear.quant_method,
                                                           "quantize_activations", False))
                else:   # packed GEMM panels (`UnquantizedLinearMethod.packed`) or [N, K]
                    s.packed[i] = int(_is_packed(linear))
            s.input_norm = _ptr(layer.input_layernorm.weight)
            s.post_norm = _ptr(layer.post_attention_layernorm.weight)
            s.qkv, s.qkv_bias = weight_ptr(linears[0]), f32(linears[0].bias)
            s.q_norm = _ptr(attn.q_norm.weight) if attn.q_norm is not None else None
            s.k_norm = _ptr(attn.k_norm.weight) if attn.k_norm is not None else None
            s.o, s.o_bias = weight_ptr(linears[1]), f32(linears[1].bias)
            s.gate_up, s.gate_up_bias = weight_ptr(linears[2]), f32(linears[2].bias)
            s.down, s.down_bias = weight_ptr(linears[3]), f32(linears[3].bias)
            s.key_cache, s.value_cache = _ptr(cache[0]), _ptr(cache[1])
            s.cos_cache, s.sin_cache = f32(rope.cos_cache), f32(rope.sin_cache)
            s.hidden_size, s.head_size = self.hidden_size, attn.head_size
            s.num_heads, s.num_kv_heads = attn.num_heads, attn.num_kv_heads
            s.intermediate_size = self.intermediate_size
            s.eps, s.scale = layer.input_layernorm.eps, attn.attn.scale
        if self._lora_layers is not None:
            for s, lora in zip(structs, self._lora_layers):
                s.lora = ctypes.addressof(lora)
        self._keepalive = keep + keep_structs
        return structs

    def __call__(self, positions: torch.Tensor, residual: torch.Tensor,
                 delta: torch.Tensor | None, metadata: CpuPagedMetadata,
                 capture: dict[int, torch.Tensor] | None = None) -> torch.Tensor:
        """Run the layers over one step.

        Args:
            positions: [n] int64.
            residual: [n, hidden_size] in the model dtype, contiguous: the stream entering the
                first layer; updated in place.
            delta: [n, hidden_size] float32, output of the layer before (added to `residual`
                first), or None (the first stage: `residual` holds the embeddings).
            metadata: the step's `CpuPagedMetadata` (`applies` returned True).
            capture: {layer index in this stack: None}; filled with the stream entering each
                of those layers ([n, hidden_size], model dtype; EAGLE-3's auxiliary states).
                The layers then run as several native calls split at those layers.

        Returns:
            [n, hidden_size] float32: the last layer's output, not yet added to `residual`.
        """
        structs = self.layer_structs()
        common = metadata.common
        n, hidden = residual.shape
        out = delta if delta is not None else torch.empty(n, hidden, dtype=torch.float32)
        positions = positions if positions.dtype == torch.int64 else positions.long()
        step, scratch = self.decoder_step(
            n, positions.data_ptr(), common.slot_mapping[:n].data_ptr(), common.block_table,
            metadata.query_start_loc.ctypes.data, metadata.seq_lens.ctypes.data,
            common.num_reqs, common.block_size, common.causal, residual.data_ptr(),
            out.data_ptr(), query_tile=1 if common.batch_invariant else 0)
        rows = metadata.all_rows
        stops = sorted(i for i in (capture or {}) if 0 <= i < len(self.layers))
        start, pending = 0, delta is not None     # pending: `out` holds a delta not yet added
        size = ctypes.sizeof(DecoderLayerWeights)
        for stop in stops + [len(self.layers)]:
            if stop > start:
                cpu_kernels().decoder_layers(ctypes.addressof(structs) + start * size,
                                             stop - start, ctypes.addressof(step),
                                             rows.ctypes.data, len(rows), int(pending),
                                             _DTYPE_CODES[self.dtype])
                pending, start = True, stop
            if capture is not None and stop in capture:
                capture[stop] = ((residual.float() + out).to(residual.dtype) if pending
                                 else residual.clone())
        del scratch
        return out

    def forget_structures(self) -> None:
        """Rebuild the native structures at the next call: the weights' storage or values
        changed (sleep mode, weight updates; biases and RoPE tables are copied at build)."""
        self._structs = None
        self._caches = []

    def layer_structs(self) -> ctypes.Array:
        """The layers' native structures, rebuilt if a layer's KV cache was replaced."""
        caches = [attn.kv_cache for attn in self.attention]
        if self._structs is None or any(a is not b for a, b in zip(caches, self._caches)):
            self._structs, self._caches = self._build(), caches
        return self._structs

    def decoder_step(self, num_tokens: int, positions: int, slot_mapping: int,
                     block_table: torch.Tensor, query_start_loc: int, seq_lens: int,
                     num_reqs: int, block_size: int, causal: bool, residual: int,
                     delta: int, query_tile: int = 0) -> tuple[DecoderStep, torch.Tensor]:
        """The `DecoderStep` of a step of `num_tokens` tokens over these buffers (addresses:
        positions [n] int64, slot_mapping [n] int64, query_start_loc [num_reqs + 1] int32,
        seq_lens [num_reqs] int32, residual [n, hidden] model dtype, delta [n, hidden]
        float32), with its float32 scratch (this decoder's, shared by its steps: one step at a
        time); keep the tensor alive while the step is in use. `query_tile`: the attention's
        query tokens per work item (0: the kernel's default; 1: every token on the per-token
        path, the batch-invariant mode). With adapters attached it carries the step's adapter
        tokens (`lora_step`), which must be mapped for a batch of `num_tokens`.

        Raises:
            ValueError: the block table [num_reqs, max_blocks] is not int32 with unit column
                stride, or adapter rows mapped for another batch size.
        """
        if block_table.dtype != torch.int32 or block_table.stride(1) != 1:
            raise ValueError("fused decoder: the block table must be int32 with unit column stride")
        needed = num_tokens * sum(self._scratch_sizes)
        if self._scratch.numel() < needed:
            self._scratch = torch.empty(needed, dtype=torch.float32)
        scratch = self._scratch
        parts, offset = [], scratch.data_ptr()
        for size in self._scratch_sizes:
            parts.append(offset)
            offset += num_tokens * size * 4
        step = DecoderStep(
            num_tokens=num_tokens, positions=positions, slot_mapping=slot_mapping,
            block_table=block_table.data_ptr(), block_table_stride=block_table.stride(0),
            query_start_loc=query_start_loc, seq_lens=seq_lens, num_reqs=num_reqs,
            block_size=block_size, causal=int(causal), query_tile=query_tile,
            residual=residual, delta=delta,
            normed=parts[0], qkv_out=parts[1], attn_out=parts[2], gate_up_out=parts[3],
            act=parts[4])
        lora = self.lora_step()
        if lora is not None:
            if lora.batch_tokens != num_tokens:
                raise ValueError(f"fused decoder: adapter rows mapped for {lora.batch_tokens} "
                                 f"tokens, the step has {num_tokens}")
            step.lora = lora.address
        return step, scratch

    def max_step_tokens(self) -> int:
        """Most tokens of a step this path takes (scratch bound and the platform's limit)."""
        return min(self._max_tokens, current_platform.fused_decoder_max_tokens(
            self.dtype, self.packed_weights))


def add_rms_norm(residual: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> torch.Tensor:
    """residual += delta (in place, model dtype) and return rms_norm(residual) * weight.

    Args:
        residual: [n, hidden] float32 or bfloat16, contiguous.
        delta: [n, hidden] float32 contiguous, or None.
        weight: [hidden], residual's dtype.

    Returns:
        [n, hidden] in residual's dtype.
    """
    out = torch.empty_like(residual)
    cpu_kernels().add_rms_norm(residual.data_ptr(), _ptr(delta), residual.shape[0],
                               residual.shape[1], weight.data_ptr(), eps, out.data_ptr(),
                               _DTYPE_CODES[residual.dtype])
    return out
