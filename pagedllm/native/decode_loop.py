"""Native greedy decode steps for the Llama family, DeepSeek-class MLA models and Qwen3-Next /
Qwen3.5 on the CPU (`decode_greedy_steps`; `HybridGreedyDecodeLoop` for the latter two, over
native/hybrid_stack.py, which also advances Qwen3-Next's state slots and copies prefix
caching's block-boundary checkpoints as the runner would between steps).

The later steps of a multi-step round (worker/multi_step.py `run_remaining_steps`) whose
requests are all plain greedy run here in one native call: per step the embedding lookup, the
fused decoder (native/fused_decoder.py), the final RMSNorm, the LM head and the argmax, with the
positions, slot mapping and sequence lengths advanced natively (see the header of
`pagedllm/native/kernels/csrc/cpu_decode_loop.cpp`). The kernels and roundings are the module path's,
so the tokens equal single steps'. It exists because at batch 1 of a small model the ~25
Python/torch calls around the fused decoder cost a noticeable share of a step on a 2-core CPU
(docs/benchmarks.md, "Measurements behind choices in the code").

It applies to a `LlamaForCausalLM` whose forward and logits are the base class's (no
embedding scale or logit soft-capping), one pipeline stage and one tensor-parallel rank, an
embedding and LM head stored as GGUF blocks or packed panels (an untied float embedding as plain
rows), and steps the fused decoder takes (`FusedDecoder.applies`'s conditions).
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch

from pagedllm.native.kernels import abi, cpu_kernels
from pagedllm.native.kernels.quantized_ops import gguf_segment_structs
from pagedllm.native.attach import NativeDecoderStack
from pagedllm.native.fused_decoder import _DTYPE_CODES, FusedDecoder


# VocabWeight.kind (abi.py)
DENSE, PACKED, GGUF, GGUF_Q8 = 0, 1, 2, 3


# HybridLayer.kind (abi.py; native/hybrid_stack.py names them)
MLA_KIND, GDN_KIND = 0, 1

VocabWeight = abi.struct("VocabWeight")
DecodeLoopArgs = abi.struct("DecodeLoopArgs")
HybridStep = abi.struct("HybridStep")
NativeAttentionStep = abi.struct("NativeAttentionStep")
StateBatch = abi.struct("StateBatch")


def _vocab_weight(module, dtype: torch.dtype, embedding: bool,
                  keep: list) -> VocabWeight | None:
    """The native description of an embedding table or LM head (a `VocabEmbedding`), or None
    for a storage the loop does not take."""
    method = module.quant_method
    weight = module.weight
    if method is not None:
        if method.tensor_type is None or (embedding and method.dtype != dtype):
            return None
        segments = gguf_segment_structs([(0, method.tensor_type, weight, method.grouped)],
                                        module.embedding_dim)
        keep.append(segments)
        kind = GGUF_Q8 if method.quantize_activations and not embedding else GGUF
        return VocabWeight(kind=kind, dtype=0, data=None, segments=ctypes.addressof(segments),
                           num_segments=1, rows=weight.shape[0], cols=module.embedding_dim)
    if weight.dtype not in _DTYPE_CODES or not weight.is_contiguous():
        return None
    if not module.packed and not embedding:
        return None
    if embedding and weight.dtype != dtype:
        return None
    return VocabWeight(kind=PACKED if module.packed else DENSE, dtype=_DTYPE_CODES[weight.dtype],
                       data=weight.data_ptr(), segments=None, num_segments=0,
                       rows=module.num_embeddings, cols=module.embedding_dim)


def _stop_arrays(stop_token_ids: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """(stop_offsets [B + 1], stop_ids) int64, as `DecodeLoopArgs` reads them."""
    stop_offsets = np.zeros(len(stop_token_ids) + 1, dtype=np.int64)
    np.cumsum([len(s) for s in stop_token_ids], out=stop_offsets[1:])
    stop_ids = np.array([t for s in stop_token_ids for t in s] or [0], dtype=np.int64)
    return stop_offsets, stop_ids


def _vocab_weights(model, embed_tokens, dtype: torch.dtype, hidden_size: int
                   ) -> tuple[VocabWeight, VocabWeight, list] | None:
    """(embedding, LM head, the structures they point into) of `model` (`embed_tokens`: its
    embedding), or None where the loop does not take either storage."""
    keep: list = []
    embedding = _vocab_weight(embed_tokens, dtype, True, keep)
    head = _vocab_weight(model.lm_head, dtype, False, keep)
    if embedding is None or head is None or head.cols != hidden_size:
        return None
    return embedding, head, keep


def _run_steps(args: DecodeLoopArgs, tokens: np.ndarray, num_steps: int,
               embedding_rows: int) -> np.ndarray:
    """`decode_greedy_steps` over `args` from `tokens` ([B] int64): tokens [steps_run, B].

    Raises:
        ValueError: the kernel refused a token id or a weight.
    """
    out = np.zeros((num_steps, len(tokens)), dtype=np.int64)
    steps_run = cpu_kernels().decode_greedy_steps(ctypes.byref(args), tokens.ctypes.data,
                                                  num_steps, out.ctypes.data)
    if steps_run < 0:
        raise ValueError(f"decode loop: a token id outside [0, {embedding_rows}), a weight "
                         f"the kernels do not take or a state slot out of range")
    return out[:steps_run]


class GreedyDecodeLoop:
    """Runs greedy decode steps of `model` (a `LlamaForCausalLM`) natively; see the module
    docstring. Build with `for_model`, which returns None where it does not apply."""

    def __init__(self, model, fused: FusedDecoder, embedding: VocabWeight, head: VocabWeight,
                 keep: list) -> None:
        self.model = model
        self.fused = fused
        self.embedding, self.head = embedding, head
        self._keep = keep
        self.vocab_size = head.rows

    @classmethod
    def for_model(cls, model) -> GreedyDecodeLoop | None:
        from pagedllm.models.llama import LlamaForCausalLM, LlamaModel
        inner = getattr(model, "model", None)
        if (cpu_kernels() is None or not isinstance(model, LlamaForCausalLM)
                or type(model).compute_logits is not LlamaForCausalLM.compute_logits
                or type(inner).forward is not LlamaModel.forward
                or not (inner.pp.is_first_rank and inner.pp.is_last_rank)
                or model.lm_head.tp_size != 1):
            return None
        stack = inner.layer_stack
        if not isinstance(stack, NativeDecoderStack):
            return None
        fused = stack.fused
        weights = _vocab_weights(model, inner.embed_tokens, fused.dtype, fused.hidden_size)
        return None if weights is None else cls(model, fused, *weights)

    def applies(self, num_reqs: int, max_seq_len: int, batch_invariant: bool = False) -> bool:
        """Whether steps of `num_reqs` requests up to sequences of `max_seq_len` tokens can run
        here (the fused decoder's conditions: KV cache in the model dtype, batch size, window;
        in the batch-invariant mode, whether the fused decoder takes every step)."""
        return self.fused.takes(num_reqs, max_seq_len, batch_invariant)

    def run(self, token_ids: np.ndarray, positions: np.ndarray, block_table: torch.Tensor,
            block_size: int, num_steps: int, stop_token_ids: list[list[int]]
            ) -> np.ndarray:
        """Decode up to `num_steps` greedy tokens per request (plain greedy: no min_tokens,
        nothing that edits the logits), ending after the step where a request samples one of
        its stop tokens (the others go on in the next round).

        Args:
            token_ids: [B] int64, each request's last token (the first step's input).
            positions: [B] int64, each request's last computed position: `token_ids` go to
                positions + 1, their successors to positions + 2, ...
            block_table: [B, max_blocks] int32, unit column stride, covering every position
                up to positions + num_steps.
            block_size: tokens per KV block.
            num_steps: most steps to run.
            stop_token_ids: per request, the token ids that end it.

        Returns:
            tokens [steps_run, B] int64: step s's token of request b is tokens[s, b].

        Raises:
            ValueError: a token id outside the embedding, a weight the kernels refuse, or a
                block table that is not int32 with unit column stride.
        """
        return self._run(token_ids, positions, block_table, block_size, num_steps,
                         stop_token_ids, None)[0]

    def run_with_states(self, token_ids: np.ndarray, positions: np.ndarray,
                        block_table: torch.Tensor, block_size: int,
                        aux_layers: tuple[int, ...] | None
                        ) -> tuple[np.ndarray, torch.Tensor]:
        """One greedy step (`run` with num_steps = 1 and no stop tokens) that also returns the
        hidden states an EAGLE head reads: the final norm's output, or with `aux_layers` the
        streams entering those layers (EAGLE-3), as the module path and the fused decoder
        stack (`NativeDecoderStack`) return them, with the same roundings.

        Args:
            token_ids, positions, block_table, block_size: as `run`.
            aux_layers: non-decreasing layer indices below the number of layers, or None
                (the final norm's output).

        Returns:
            (tokens [B] int64, states: [B, hidden_size] (None) or [B, len(aux_layers) *
            hidden_size] (the streams side by side, in `aux_layers` order), model dtype).

        Raises:
            ValueError: as `run`, or auxiliary layers that are not non-decreasing
                indices of this stack's layers.
        """
        out, states = self._run(token_ids, positions, block_table, block_size, 1,
                                [[] for _ in range(len(token_ids))], aux_layers)
        return out[0], states

    def _run(self, token_ids: np.ndarray, positions: np.ndarray, block_table: torch.Tensor,
             block_size: int, num_steps: int, stop_token_ids: list[list[int]],
             aux_layers: tuple[int, ...] | None) -> tuple[np.ndarray, torch.Tensor]:
        """`run`'s steps -> (tokens [steps_run, B], the last step's states as
        `run_with_states` returns them)."""
        fused = self.fused
        n, hidden = len(token_ids), fused.hidden_size
        structs = fused.layer_structs()
        tokens = np.ascontiguousarray(token_ids, dtype=np.int64).copy()
        pos = np.ascontiguousarray(positions, dtype=np.int64).copy()
        loop = _LoopBuffers(n, pos, block_table, block_size)
        residual = torch.empty(n, hidden, dtype=fused.dtype)
        delta = torch.empty(n, hidden, dtype=torch.float32)
        normed = torch.empty(n, hidden, dtype=fused.dtype)
        step, scratch = fused.decoder_step(
            n, pos.ctypes.data, loop.slots.ctypes.data, block_table,
            loop.query_start_loc.ctypes.data, loop.seq_lens.ctypes.data, n, block_size, True,
            residual.data_ptr(), delta.data_ptr())
        aux = np.asarray(aux_layers or (), dtype=np.int64)
        if len(aux) and (int(aux[0]) < 0 or int(aux[-1]) >= len(fused.layers)
                         or bool((np.diff(aux) < 0).any())):
            raise ValueError(f"decode loop: auxiliary layers {tuple(aux_layers)} are not "
                             f"non-decreasing indices below {len(fused.layers)}")
        aux_out = torch.empty(n, len(aux) * hidden, dtype=fused.dtype) if len(aux) else None
        args = loop.args(
            self, _DTYPE_CODES[fused.dtype], residual, delta, normed, self.model.model.norm,
            stop_token_ids, layers=ctypes.addressof(structs), num_layers=len(fused.layers),
            step=ctypes.addressof(step), aux_layers=aux.ctypes.data if len(aux) else None,
            num_aux=len(aux), aux_out=None if aux_out is None else aux_out.data_ptr())
        out = _run_steps(args, tokens, num_steps, self.embedding.rows)
        del scratch
        return out, (normed if aux_out is None else aux_out)


class HybridGreedyDecodeLoop:
    """Greedy decode steps of a DeepSeek-V2/V3 / GLM-4-MoE model (`MoeForCausalLM` with a
    `NativeHybridStack` of MLA layers, native/hybrid_stack.py) or a Qwen3-Next / Qwen3.5 model
    (`HybridForCausalLM` with a stack of Gated DeltaNet and gated-attention layers) in one
    native call, as `GreedyDecodeLoop` runs them for Llama: per step the embedding,
    `hybrid_decoder_layers`, the final norm, the LM head and the argmax, positions, KV slots
    and (Qwen3-Next) state slots advanced natively. The layers are the stack's (the per-half
    kernels), so the tokens equal single steps'.

    DeepSeek: float32 models only (the final add and norm are `add_rms_norm`'s, which for
    bfloat16 rounds once where the module's RMSNorm rounds twice). Qwen3-Next: float32 and
    bfloat16, since its final GemmaRMSNorm is the stack's own (`hybrid_decoder_layers` computes
    it for single steps too). Build with `for_model` (None where it does not apply); `applies`
    and `run` as `GreedyDecodeLoop`'s, `run` with the state group's block table for
    Qwen3-Next.
    """

    def __init__(self, model, owner, embedding: VocabWeight, head: VocabWeight,
                 keep: list) -> None:
        self.model = model
        self.owner = owner                 # the module whose `layer_stack` is the stack
        self.stack = owner.layer_stack
        self.embedding, self.head = embedding, head
        self._keep = keep
        self.vocab_size = head.rows
        self._scratch = torch.empty(0, dtype=torch.float32)
        self._state_scratch = torch.empty(0, dtype=torch.float32)

    @classmethod
    def for_model(cls, model) -> HybridGreedyDecodeLoop | None:
        from pagedllm.models.hybrid import HybridForCausalLM
        from pagedllm.models.llama import LlamaModel
        from pagedllm.models.moe import MoeForCausalLM
        from pagedllm.native.hybrid_stack import MLA, NativeHybridStack
        lm_head = getattr(model, "lm_head", None)   # none at the top of a vision-language model
        if cpu_kernels() is None or lm_head is None or getattr(lm_head, "tp_size", 1) != 1:
            return None
        if isinstance(model, HybridForCausalLM):
            stack = model.layer_stack
            if (not isinstance(stack, NativeHybridStack) or MLA in stack.kinds
                    or model.embedding_multiplier is not None
                    or type(model).forward is not HybridForCausalLM.forward
                    or type(model).compute_logits is not HybridForCausalLM.compute_logits):
                return None
            stack_name, embedding, _ = model._module_names
            weights = _vocab_weights(model, getattr(getattr(model, stack_name), embedding),
                                     stack.dtype, stack.hidden_size)
            return None if weights is None else cls(model, model, *weights)
        inner = getattr(model, "model", None)
        stack = getattr(inner, "layer_stack", None)
        if (not isinstance(model, MoeForCausalLM)
                or not isinstance(stack, NativeHybridStack) or set(stack.kinds) != {MLA}
                or stack.dtype != torch.float32
                or type(model).forward is not MoeForCausalLM.forward
                or type(model).compute_logits is not MoeForCausalLM.compute_logits
                or type(inner).forward is not LlamaModel.forward
                or not (inner.pp.is_first_rank and inner.pp.is_last_rank)):
            return None
        weights = _vocab_weights(model, inner.embed_tokens, stack.dtype, stack.hidden_size)
        return None if weights is None else cls(model, inner, *weights)

    @property
    def has_state(self) -> bool:
        """Whether the stack has recurrent (Gated DeltaNet) layers: `run` then needs the
        state group's block table."""
        return GDN_KIND in self.stack.kinds

    def applies(self, num_reqs: int, max_seq_len: int, batch_invariant: bool = False) -> bool:
        """Whether decode steps of `num_reqs` requests up to sequences of `max_seq_len` tokens
        run here: not the batch-invariant mode (the attention halves decline it), the stack
        still attached, and every layer's halves taking such steps
        (`NativeHybridStack.loop_ready`)."""
        return (not batch_invariant and self.owner.layer_stack is self.stack
                and self.stack.loop_ready(num_reqs, max_seq_len))

    def run(self, token_ids: np.ndarray, positions: np.ndarray, block_table: torch.Tensor,
            block_size: int, num_steps: int, stop_token_ids: list[list[int]],
            state_table: torch.Tensor | None = None, state_align: bool = False
            ) -> np.ndarray:
        """As `GreedyDecodeLoop.run` (same arguments, result and errors), and for a stack with
        recurrent layers:

        Args:
            state_table: [B, max_entries] int32, unit column stride, the state group's block
                table of the same rows: column 0 is each request's state slot, or with
                `state_align` (prefix caching's mode "align") column p // block_size is the
                slot of the step at position p, covering every position the steps reach.
            state_align: the state group is position-aligned (see the C++ header).

        Raises:
            ValueError: also for a missing or malformed `state_table` where the stack has
                recurrent layers, or a state slot out of range.
        """
        stack = self.stack
        n, hidden = len(token_ids), stack.hidden_size
        for name, table in (("block table", block_table), ("state table", state_table)):
            if table is not None and (table.dtype != torch.int32 or table.stride(1) != 1):
                raise ValueError(f"decode loop: the {name} must be int32 with unit column "
                                 f"stride")
        if self.has_state and state_table is None:
            raise ValueError("decode loop: a stack with recurrent layers needs the state "
                             "group's block table")
        tokens = np.ascontiguousarray(token_ids, dtype=np.int64).copy()
        pos = np.ascontiguousarray(positions, dtype=np.int64).copy()
        if not stack.loop_ready(n, int(pos.max(initial=0)) + 1 + num_steps):
            raise ValueError("decode loop: the model's native halves do not take these steps")
        loop = _LoopBuffers(n, pos, block_table, block_size)
        attention = loop.attention_step(self._attention_scratch(n), MLA_KIND in stack.kinds)
        residual = torch.empty(n, hidden, dtype=stack.dtype)
        delta = torch.empty(n, hidden, dtype=torch.float32)
        normed = torch.empty(n, hidden, dtype=stack.dtype)
        buf = stack.buffers(n)
        step = HybridStep(num_tokens=n, hidden_size=hidden, dtype=stack.dtype_code,
                          stream=residual.data_ptr(), hidden=delta.data_ptr(),
                          normed=buf[1].data_ptr(), mlp_out=buf[2].data_ptr(), add_first=0)
        state = None
        if MLA_KIND in stack.kinds:
            step.mla_step = ctypes.addressof(attention)
        else:
            # Qwen3-Next: the stream is `residual`, `hidden` a scratch row block, and the
            # final norm (the stack's) writes `normed`, which the LM head reads.
            step.hidden = buf[0].data_ptr()
            step.attention_step = ctypes.addressof(attention)
            stack.set_final_norm(step, normed)
            if self.has_state:
                state = _StateSlots(stack, n, state_table, state_align)
                step.state_batch = ctypes.addressof(state.batch)
                step.state_scratch = self._state_scratch_rows(n).data_ptr()
        args = loop.args(self, stack.dtype_code, residual, delta, normed, stack.norm,
                         stop_token_ids, layers=None, num_layers=len(stack.mixers), step=None,
                         hybrid_layers=ctypes.addressof(stack.layers),
                         hybrid_step=ctypes.addressof(step))
        if state is not None:
            state.fill(args)
        return _run_steps(args, tokens, num_steps, self.embedding.rows)

    def _attention_scratch(self, n: int) -> torch.Tensor:
        """Float32 scratch for the attention layers' step (n rows of the largest need)."""
        needed = n * max((m.scratch_floats for m, k in zip(self.stack.mixers, self.stack.kinds)
                          if k != GDN_KIND), default=0)
        if self._scratch.numel() < max(needed, 1):
            self._scratch = torch.empty(max(needed, 1), dtype=torch.float32)
        return self._scratch

    def _state_scratch_rows(self, n: int) -> torch.Tensor:
        """Float32 scratch for the Gated DeltaNet layers (`HybridStep.state_scratch`)."""
        needed = n * max(m.scratch_floats for m, k in zip(self.stack.mixers, self.stack.kinds)
                         if k == GDN_KIND)
        if self._state_scratch.numel() < needed:
            self._state_scratch = torch.empty(needed, dtype=torch.float32)
        return self._state_scratch


class _LoopBuffers:
    """The per-row arrays a round advances natively (positions in the caller's array): slot
    mapping, sequence lengths, query starts and attention rows, for B decode rows."""

    def __init__(self, n: int, pos: np.ndarray, block_table: torch.Tensor,
                 block_size: int) -> None:
        self.n, self.pos, self.block_table, self.block_size = n, pos, block_table, block_size
        self.slots = np.zeros(n, dtype=np.int64)
        self.seq_lens = (pos + 1).astype(np.int32)
        self.query_start_loc = np.arange(n + 1, dtype=np.int32)
        self.rows = np.arange(n, dtype=np.int32)
        self._keep: list = []

    def args(self, loop, dtype_code: int, residual: torch.Tensor, delta: torch.Tensor,
             normed: torch.Tensor, norm, stop_token_ids: list[list[int]],
             **fields) -> DecodeLoopArgs:
        """The `DecodeLoopArgs` over these arrays: what both loops set (`loop`'s embedding and
        LM head, the final `norm`, the stream `residual` [B, H] model dtype, `delta` [B, H]
        float32, `normed` [B, H] model dtype, the stop tokens), the LM head's float32 buffers
        (allocated here and kept with this object), and the stack's own `fields`."""
        n, hidden = self.n, residual.shape[1]
        head_x = torch.empty(n, hidden, dtype=torch.float32)
        embed_f32 = torch.empty(n, hidden, dtype=torch.float32)
        logits = torch.empty(n, loop.vocab_size, dtype=torch.float32)
        stop_offsets, stop_ids = _stop_arrays(stop_token_ids)
        self._keep += [head_x, embed_f32, logits, stop_offsets, stop_ids]
        table = self.block_table
        return DecodeLoopArgs(
            dtype=dtype_code, num_reqs=n, hidden=hidden, block_size=self.block_size,
            block_table_stride=table.stride(0), block_table=table.data_ptr(),
            attention_rows=self.rows.ctypes.data, positions=self.pos.ctypes.data,
            slot_mapping=self.slots.ctypes.data, seq_lens=self.seq_lens.ctypes.data,
            residual=residual.data_ptr(), delta=delta.data_ptr(), normed=normed.data_ptr(),
            head_x=head_x.data_ptr(), logits=logits.data_ptr(), embed_f32=embed_f32.data_ptr(),
            embedding=loop.embedding, head=loop.head, norm_weight=norm.weight.data_ptr(),
            norm_eps=norm.eps, stop_offsets=stop_offsets.ctypes.data,
            stop_ids=stop_ids.ctypes.data, **fields)

    def attention_step(self, scratch: torch.Tensor, mla: bool) -> NativeAttentionStep:
        """The attention layers' step over these arrays (one query token per row), with the
        query tile the layers' own steps use (MLA: its tile for one token; gated attention:
        0, the kernel's default)."""
        from pagedllm.attention.backends.mla_cpu import _query_tile
        table = self.block_table
        return NativeAttentionStep(
            num_tokens=self.n, positions=self.pos.ctypes.data,
            slot_mapping=self.slots.ctypes.data, block_table=table.data_ptr(),
            block_table_stride=table.stride(0), query_start_loc=self.query_start_loc.ctypes.data,
            seq_lens=self.seq_lens.ctypes.data, rows=self.rows.ctypes.data, num_rows=self.n,
            block_size=self.block_size, causal=1, query_tile=_query_tile(1) if mla else 0,
            scratch=scratch.data_ptr())


class _StateSlots:
    """The Gated DeltaNet layers' `StateBatch` of a round's decode rows (each row one token
    with its computed prefix as initial state), the slots set per step in C++ (mode "align")
    or once here (column 0 of the state group's table)."""

    def __init__(self, stack, n: int, state_table: torch.Tensor, align: bool) -> None:
        gdn = stack.mixers[stack.kinds.index(GDN_KIND)]
        self.table, self.align = state_table, align
        self.query_start_loc = np.arange(n + 1, dtype=np.int64)
        self.state_indices = state_table[:n, 0].numpy().astype(np.int64)
        self.has_initial_state = np.ones(n, dtype=np.uint8)
        self.batch = StateBatch(query_start_loc=self.query_start_loc.ctypes.data,
                                state_indices=self.state_indices.ctypes.data,
                                has_initial_state=self.has_initial_state.ctypes.data,
                                num_reqs=n, num_slots=gdn.num_slots)

    def fill(self, args: DecodeLoopArgs) -> None:
        """Point `args` at the state slots (the table only in mode "align")."""
        args.state_indices = self.state_indices.ctypes.data
        if self.align:
            args.state_table = self.table.data_ptr()
            args.state_table_stride = self.table.stride(0)
