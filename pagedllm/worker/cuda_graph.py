"""CUDA graphs for decode steps (`cudagraph_mode="FULL_DECODE_ONLY"`, vLLM's mode of that name).

A step in which every request decodes one token is padded to the next captured batch size and
replays a graph of the whole forward captured at that size; every other step (prefill chunks,
speculative verification, batches larger than the largest size) runs eagerly. This module owns:

- the capture sizes (`default_capture_sizes`, `resolve_capture_sizes`) and the padding rule
  (`pad_to_capture_size`, `cudagraph_batch_size`): pure functions of ints;
- `CudaGraphInputBuffers`: the persistent device tensors a captured graph reads. A graph bakes in
  pointers, so each step copies its inputs into the same buffers before a replay:

      tokens   [ t0 t1 t2 | pad pad ]        padded_size = 5, num_reqs = 3
      input_ids / positions: real, then 0    slot_mapping: real, then -1 (PAD_SLOT_ID: no write)
      query_start_loc = [0 1 2 3 | 4 5]      seq_lens = [s0 s1 s2 | 1 1]
      block_table rows of padding = 0        (the null block: reads zeros, never written)

- `CudaGraphRunner`: capture (largest size first, sharing one memory pool) and replay; CUDA only.
  The model runner asks it `can_run(common)` and calls `run(input_ids, positions, commons)`,
  which pads, copies into the buffers, replays and returns the real rows' hidden states.
  Built with `replay_eagerly=True` it runs the same padded persistent-buffer path without
  graphs (the CPU test seam: only capture and replay are replaced).
- `decode_graph_capture_sizes`: whether (and at which sizes) a runner captures at all.

Only attention backends whose launches depend on nothing but device tensors and the padded sizes
may be captured (`supports_cuda_graphs` on the backend class: `triton_paged`). The runner never
decides policy here: it asks `cudagraph_batch_size` and passes the result.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable, Sequence

import numpy as np
import torch

from pagedllm.attention.metadata import CommonAttentionMetadata
from pagedllm.config import CudaGraphConfig

logger = logging.getLogger(__name__)

PAD_SLOT_ID = -1
# vLLM's cap on the default sizes: beyond it a graph saves little next to the batch's compute.
_MAX_DEFAULT_CAPTURE_SIZE = 512


def default_capture_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """vLLM's default sizes, 1, 2, 4, then every 8 up to 248, then every 16, kept to sizes
    <= min(max_num_seqs, 512); `max_num_seqs` itself is added when it is within the cap (so
    every decode batch pads to some size; vLLM leaves the largest batches eager instead).

    Raises:
        ValueError: if max_num_seqs < 1.
    """
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    cap = min(max_num_seqs, _MAX_DEFAULT_CAPTURE_SIZE)
    sizes = [1, 2, 4] + list(range(8, 256, 8)) + list(range(256, cap + 1, 16))
    sizes = [n for n in sizes if n <= cap]
    if sizes[-1] != cap:
        sizes.append(cap)
    return tuple(sizes)


def resolve_capture_sizes(config: CudaGraphConfig, max_num_seqs: int,
                          backend_supports_graphs: bool) -> tuple[int, ...]:
    """The sizes to capture: none for mode NONE, enforce_eager or a backend that cannot be
    captured; else `config.cudagraph_capture_sizes` (default: `default_capture_sizes`) without
    the sizes above max_num_seqs (a decode batch never has more tokens than requests)."""
    if config.enforce_eager or config.cudagraph_mode == "NONE" or not backend_supports_graphs:
        return ()
    sizes = config.cudagraph_capture_sizes or default_capture_sizes(max_num_seqs)
    return tuple(n for n in sizes if n <= max_num_seqs)


def pad_to_capture_size(num_tokens: int, capture_sizes: Sequence[int]) -> int | None:
    """The smallest capture size >= num_tokens, or None when there is none (run eagerly).
    `capture_sizes` must be ascending."""
    i = bisect.bisect_left(capture_sizes, num_tokens)
    return capture_sizes[i] if i < len(capture_sizes) else None


def cudagraph_batch_size(capture_sizes: Sequence[int], num_reqs: int, num_tokens: int,
                         max_query_len: int) -> int | None:
    """The padded batch size to replay for this step, or None to run it eagerly: only steps in
    which every request decodes exactly one token (FULL_DECODE_ONLY) replay."""
    if num_tokens == 0 or max_query_len != 1 or num_tokens != num_reqs:
        return None
    return pad_to_capture_size(num_tokens, capture_sizes)


def decode_graph_capture_sizes(config: CudaGraphConfig, max_num_seqs: int, device: torch.device,
                               backend: type, model: torch.nn.Module,
                               world_size: int = 1) -> tuple[int, ...]:
    """The sizes a model runner captures: `resolve_capture_sizes`, and none (eager only, with
    the reason logged) off CUDA, with several ranks, or for a model whose forward does host work
    that a graph would freeze.

    NOTE(cuda_graph): a captured forward must depend on nothing but the persistent device
    buffers and the padded size. Two forwards here do not: the fused MoE layer counts tokens per
    expert on the host (`.tolist()`, a sync a capture refuses), and Phi-3's long-context RoPE
    picks its table from `seq_lens_cpu` (a host array a graph would bake in). Several ranks
    (collectives, pipeline send/recv inside the forward) are not captured until tested on a
    multi-GPU machine (issue #20).
    """
    if device.type != "cuda" or not torch.cuda.is_available():
        return ()
    sizes = resolve_capture_sizes(config, max_num_seqs,
                                  getattr(backend, "supports_cuda_graphs", False))
    if not sizes:
        return ()
    from pagedllm.layers.fused_moe import FusedMoE

    reason = None
    if world_size > 1:
        reason = f"{world_size} ranks"
    elif any(isinstance(m, FusedMoE) for m in model.modules()):
        reason = "the fused MoE layer syncs with the host"
    elif getattr(model, "state_layers", None) is not None:
        reason = "recurrent (state-cache) layers split the batch by host-side query lengths"
    elif getattr(model, "_original_max_position", None) is not None:
        reason = "long-context RoPE reads host-side sequence lengths"
    if reason is not None:
        logger.info("CUDA graphs off (%s); decode steps run eagerly", reason)
        return ()
    return sizes


class CudaGraphInputBuffers:
    """The persistent inputs of captured decode graphs, sized for `max_num_seqs` requests.

    Attributes (on `device`):
        input_ids, positions: [max_num_seqs] int64.
        query_start_loc: [max_num_seqs + 1] int32.
        seq_lens: [max_num_seqs] int32.
        block_tables: [num_kv_cache_groups, max_num_seqs, max_num_blocks_per_req] int32.
        slot_mappings: [num_kv_cache_groups, max_num_seqs] int64.
    """

    def __init__(self, max_num_seqs: int, max_num_blocks_per_req: int, device: torch.device,
                 num_kv_cache_groups: int = 1) -> None:
        if max_num_seqs < 1 or max_num_blocks_per_req < 1 or num_kv_cache_groups < 1:
            raise ValueError(f"CudaGraphInputBuffers: max_num_seqs ({max_num_seqs}), "
                             f"max_num_blocks_per_req ({max_num_blocks_per_req}) and "
                             f"num_kv_cache_groups ({num_kv_cache_groups}) must be >= 1")
        self.max_num_seqs = max_num_seqs
        self.input_ids = torch.zeros(max_num_seqs, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_num_seqs, dtype=torch.int64, device=device)
        self.query_start_loc = torch.zeros(max_num_seqs + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(max_num_seqs, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(num_kv_cache_groups, max_num_seqs,
                                        max_num_blocks_per_req, dtype=torch.int32, device=device)
        self.slot_mappings = torch.full((num_kv_cache_groups, max_num_seqs), PAD_SLOT_ID,
                                        dtype=torch.int64, device=device)

    def prepare(self, input_ids: torch.Tensor, positions: torch.Tensor,
                commons: Sequence[CommonAttentionMetadata], padded_size: int
                ) -> tuple[CommonAttentionMetadata, ...]:
        """Copy a decode step into the buffers, padded to `padded_size` requests of one token.

        Args:
            input_ids, positions: [num_reqs] of the step.
            commons: the step's metadata, one per KV cache group (same requests, own block
                table and slot mapping).
            padded_size: a capture size >= num_reqs.

        Returns:
            Per group, the padded step's metadata whose tensors are views of the buffers
            (num_reqs = num_actual_tokens = padded_size, max_query_len = 1).

        Raises:
            ValueError: for a step that is not a pure decode, a group count or block table wider
                than the buffers, or a padded_size out of range.
        """
        if len(commons) != self.block_tables.shape[0]:
            raise ValueError(f"prepare: {len(commons)} metadata for "
                             f"{self.block_tables.shape[0]} KV cache groups")
        first = commons[0]
        num_reqs = first.num_reqs
        if first.num_actual_tokens != num_reqs or first.max_query_len != 1:
            raise ValueError(f"prepare: not a decode step ({first.num_actual_tokens} tokens for "
                             f"{num_reqs} requests, max_query_len {first.max_query_len})")
        if not num_reqs <= padded_size <= self.max_num_seqs:
            raise ValueError(f"prepare: padded_size {padded_size} outside [{num_reqs}, "
                             f"{self.max_num_seqs}]")
        self.input_ids[:num_reqs].copy_(input_ids[:num_reqs])
        self.positions[:num_reqs].copy_(positions[:num_reqs])
        self.seq_lens[:num_reqs].copy_(first.seq_lens[:num_reqs])
        for g, common in enumerate(commons):
            width = common.block_table.shape[1]
            if width > self.block_tables.shape[2]:
                raise ValueError(f"prepare: block table of {width} blocks per request, buffers "
                                 f"hold {self.block_tables.shape[2]}")
            self.block_tables[g, :num_reqs, :width].copy_(common.block_table[:num_reqs])
            self.slot_mappings[g, :num_reqs].copy_(common.slot_mapping[:num_reqs])
        seq_lens_cpu = self._fill_padding(num_reqs, padded_size)
        seq_lens_cpu[:num_reqs] = first.seq_lens_cpu[:num_reqs]
        return self._metadata(padded_size, seq_lens_cpu, first.block_size, first.causal)

    def prepare_dummy(self, padded_size: int,
                      block_size: int) -> tuple[CommonAttentionMetadata, ...]:
        """The buffers as a step of `padded_size` padding requests (for capture): every token
        reads the null block and writes nothing."""
        if not 1 <= padded_size <= self.max_num_seqs:
            raise ValueError(f"prepare_dummy: padded_size {padded_size} outside [1, "
                             f"{self.max_num_seqs}]")
        return self._metadata(padded_size, self._fill_padding(0, padded_size), block_size, True)

    def _fill_padding(self, num_reqs: int, padded_size: int) -> np.ndarray:
        """Padding rows [num_reqs, padded_size): token 0 at position 0, seq_len 1, the null
        block, no KV write; query_start_loc = arange (one token per request). Returns the padded
        seq_lens on the host (padding part filled)."""
        self.input_ids[num_reqs:padded_size] = 0
        self.positions[num_reqs:padded_size] = 0
        self.seq_lens[num_reqs:padded_size] = 1
        self.block_tables[:, num_reqs:padded_size] = 0
        self.slot_mappings[:, num_reqs:padded_size] = PAD_SLOT_ID
        # NOTE: stale block-table columns past a row's width are harmless: a kernel reads only
        # the blocks of positions < seq_len.
        self.query_start_loc[:padded_size + 1] = torch.arange(
            padded_size + 1, dtype=torch.int32, device=self.query_start_loc.device)
        return np.ones(padded_size, dtype=np.int32)

    def _metadata(self, padded_size: int, seq_lens_cpu: np.ndarray, block_size: int,
                  causal: bool) -> tuple[CommonAttentionMetadata, ...]:
        qsl_cpu = np.arange(padded_size + 1, dtype=np.int32)
        return tuple(
            CommonAttentionMetadata(
                query_start_loc=self.query_start_loc[:padded_size + 1],
                query_start_loc_cpu=qsl_cpu, seq_lens=self.seq_lens[:padded_size],
                seq_lens_cpu=seq_lens_cpu, block_table=self.block_tables[g, :padded_size],
                slot_mapping=self.slot_mappings[g, :padded_size], num_reqs=padded_size,
                num_actual_tokens=padded_size, max_query_len=1,
                max_seq_len=int(seq_lens_cpu.max()), block_size=block_size, causal=causal)
            for g in range(self.block_tables.shape[0]))


class CudaGraphRunner:
    """Captures the forward once per capture size and replays it.

    `forward(padded_size, commons)` runs the model over `buffers.input_ids[:padded_size]` /
    `buffers.positions[:padded_size]` with the given metadata (the model runner's closure that
    sets the forward context) and returns the hidden states [padded_size, hidden_size]; the
    graph's output tensor is returned by `replay`, overwritten by the next replay.

    Args:
        buffers: the persistent inputs every graph reads.
        capture_sizes: ascending batch sizes to capture (each <= buffers.max_num_seqs).
        block_size: tokens per KV block.
        replay_eagerly: capture no graph; `capture` runs each size once over padding and `run`
            calls the forward over the padded buffers with the step's padded metadata (host
            fields included, so CPU backends that read them stay correct). For CPU tests of the
            padding path; a real replay sees the capture-time host fields instead, which is why
            only backends that read device tensors alone may be captured.

    Raises:
        ValueError: for capture sizes that are not ascending or exceed the buffers.
    """

    def __init__(self, buffers: CudaGraphInputBuffers, capture_sizes: Sequence[int],
                 block_size: int, replay_eagerly: bool = False) -> None:
        sizes = tuple(capture_sizes)
        if list(sizes) != sorted(set(sizes)) or (sizes and (
                sizes[0] < 1 or sizes[-1] > buffers.max_num_seqs)):
            raise ValueError(f"CudaGraphRunner: capture sizes {sizes} must be ascending, "
                             f"distinct, in [1, {buffers.max_num_seqs}]")
        self.buffers = buffers
        self.capture_sizes = sizes
        self.block_size = block_size
        self.replay_eagerly = replay_eagerly
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._forward: Callable[[int, tuple[CommonAttentionMetadata, ...]],
                                torch.Tensor] | None = None
        # Padded sizes of the steps `run` served (tests read it to see which path a step took).
        self.num_runs_by_size: dict[int, int] = {}

    def capture(self, forward: Callable[[int, tuple[CommonAttentionMetadata, ...]],
                                        torch.Tensor]) -> None:
        """Capture every size, largest first so the smaller graphs reuse the memory pool of the
        largest (vLLM and nano-vllm do the same). Each size runs once eagerly before its capture
        (Triton compiles its kernels then, never inside a capture).

        Raises:
            RuntimeError: without CUDA, or when the buffers are not on a CUDA device.
        """
        if self.replay_eagerly:
            for size in sorted(self.capture_sizes, reverse=True):
                forward(size, self.buffers.prepare_dummy(size, self.block_size))
            self._forward = forward
            return
        if not torch.cuda.is_available() or self.buffers.input_ids.device.type != "cuda":
            raise RuntimeError("CUDA graph capture needs a CUDA device and CUDA buffers")
        pool = torch.cuda.graph_pool_handle()
        for size in sorted(self.capture_sizes, reverse=True):
            commons = self.buffers.prepare_dummy(size, self.block_size)
            forward(size, commons)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = forward(size, commons)
            self._graphs[size] = (graph, out)
        torch.cuda.synchronize()

    def has_graph(self, padded_size: int) -> bool:
        """Whether `padded_size` was captured (in eager mode: is a capture size, once captured)."""
        if self.replay_eagerly:
            return self._forward is not None and padded_size in self.capture_sizes
        return padded_size in self._graphs

    def padded_size(self, common: CommonAttentionMetadata) -> int | None:
        """The captured size a step pads to, or None to run it eagerly (not a pure decode step,
        or more requests than the largest captured size)."""
        size = cudagraph_batch_size(self.capture_sizes, common.num_reqs,
                                    common.num_actual_tokens, common.max_query_len)
        return size if size is not None and self.has_graph(size) else None

    def can_run(self, common: CommonAttentionMetadata) -> bool:
        """Whether the step of `common` (group 0's metadata) can replay a graph."""
        return self.padded_size(common) is not None

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor,
            commons: Sequence[CommonAttentionMetadata]) -> torch.Tensor:
        """Pad a pure decode step to its captured size, copy it into the buffers, replay, and
        return the real rows' hidden states.

        Args:
            input_ids, positions: [num_reqs] int64 of the step.
            commons: the step's metadata per KV cache group.

        Returns:
            [num_reqs, hidden_size], a view of the graph's output (valid until the next run).

        Raises:
            ValueError: for a step `can_run` refuses.
        """
        size = self.padded_size(commons[0])
        if size is None:
            raise ValueError(f"CudaGraphRunner.run: no captured size for a step of "
                             f"{commons[0].num_reqs} requests and "
                             f"{commons[0].num_actual_tokens} tokens")
        padded = self.buffers.prepare(input_ids, positions, commons, size)
        out = self._forward(size, padded) if self.replay_eagerly else self.replay(size)
        self.num_runs_by_size[size] = self.num_runs_by_size.get(size, 0) + 1
        return out[:commons[0].num_reqs]

    def replay(self, padded_size: int) -> torch.Tensor:
        """Replay the graph of `padded_size` over what `buffers.prepare` copied in; returns its
        output [padded_size, ...] (rows past the step's num_reqs are padding).

        Raises:
            KeyError: if that size was not captured.
        """
        if padded_size not in self._graphs:
            raise KeyError(f"no CUDA graph captured for batch size {padded_size} (captured: "
                           f"{sorted(self._graphs)})")
        graph, out = self._graphs[padded_size]
        graph.replay()
        return out
