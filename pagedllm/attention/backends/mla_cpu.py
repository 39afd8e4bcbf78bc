"""MLA on the CPU: absorbed decode and prefill through the native paged-attention kernel, and
expanded prefill through the native expanded-MLA kernel.

In the absorbed form (attention/backends/mla_torch.py) the H query heads of a token attend over
the request's latents as one shared KV head of size L + dr, with the latents' first L values as
the values. That is multi-query attention whose key and value caches are the same tensor, so
the native paged kernel (`csrc/cpu_attention.cpp`, the one `CpuPagedBackend` uses) runs it
unchanged: key_cache = value_cache = the latent cache, num_kv_heads 1, head_size L + dr. The
kernel walks the block table and reads each latent row where it lies (no gather into a padded
copy, no expansion); its output's last dr channels (the "values" of k_pe) are dropped. The
cost of the extra dr channels is dr / (L + dr) of the value work (11% at DeepSeek's 512 + 64).

    absorbed rows:  q = [W_UK^T q_nope | q_pe] [n, H, L + dr] -> kernel -> o_lat = out[..., :L]
                    -> W_UV o_lat
    expanded rows:  context latents gathered, kv_nope = c_kv kv_b_proj^T (one GEMM), then
                    `csrc/cpu_mla_prefill.cpp`: causal attention per head with keys
                    [W_UK_h c_kv | k_pe] and values W_UV_h c_kv read from kv_nope and k_pe
                    (`_expanded_in_kernel`); in torch (`mla_torch.attend_row_groups`, the
                    reference) on builds without that kernel (no AVX-512) or when asked

Kernel rows are the decodes (query_len 1: per-token work items, split over long contexts) and
the prefill chunks the rule below gives to the absorbed form. A chunk runs on the kernel's
query-tiled path: a work item is a tile of the chunk's consecutive query tokens, whose tokens x
H heads are the rows of one register-blocked block (`attend_tile_gemm`, AVX2 builds with (L +
dr) % 32 == 0), so each latent row is read and widened once per tile for all heads and all the
tile's queries, causal within the chunk, int8 / fp8 latents dequantized in the loop (int8: the
per-token scale on scores and probabilities; fp8: the per-tensor scale on q and the output).
Work items are tiles only (one KV head: heads are not split), so the tile length is chosen per
step to give every thread a tile (`_query_tile`).

Expanded rows (fresh prefills, long chunks) run as plain multi-head attention whose query
tokens sit in vector lanes, a tile of up to 64 tokens and one head per work item; keys and
values keep their sizes (dn + dr and dv, no padding to a common head size). For the 200M
preset's batch-32 prefill (32 x 128 fresh tokens, one thread) a layer's call took 19.6 ms
against 53.6 ms for the torch form (docs/mla.md, "The expanded form in the native kernel").

Absorbed or expanded per chunk: `mla_torch.prefers_absorbed`, the multiply-add counts of the
two forms with the kernel's cost per multiply-add relative to torch's GEMMs,
ABSORBED_COST_FACTOR, measured (docs/mla.md, "Prefill on the CPU"). A fresh prefill (no cached
prefix) always runs expanded; a short chunk over a long prefix runs absorbed below about
(dn + dv) L / (2 alpha (L + dr) - dn - dr - dv) tokens: ~100 at DeepSeek-V2's dn = dv = 128,
dr = 64, L = 512, ~25 at the 200M bench preset's 32 / 16 / 32 / 128. The split depends on the
layer's dimensions, so it is made on the step's first MLA layer call and kept in the metadata
for the others.

The batch-invariant mode runs every row through `MLATorchBackend` (a decode's floats must not
depend on the batch; the torch groups give that).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from pagedllm.attention.backends.mla_torch import (MLATorchBackend, absorbed_rows_mask,
                                                    attend_row_groups, check_prefill_form)
from pagedllm.attention.backends.torch_sdpa import TorchSDPAMetadata, build_row_group
from pagedllm.attention.metadata import CommonAttentionMetadata
from pagedllm.kv_cache_layout import (dequantize_kv, is_quantized_kv_cache, kv_cache_scales,
                                      write_cache_rows)
from pagedllm.native.kernels import cpu_kernels
from pagedllm.native.kernels.attention_ops import (mla_expanded_prefill,
                                         mla_expanded_prefill_supported, paged_attention)

# The kernel's cost per multiply-add of the absorbed form relative to torch's GEMMs in the
# expanded form (module docstring; measured in docs/mla.md, "Prefill on the CPU").
ABSORBED_COST_FACTOR = 1.25
# The kernel's register-blocked tiles are this many times its `query_tile` argument long.
_GEMM_TILE_FACTOR = 4
# Context positions expanded at a time for the kernel's expanded rows (`_expanded_in_kernel`):
# kv_nope of 8192 positions is 134 MB at V2-Lite's 16 heads x 256 float32 values (the 200M
# preset's 8 x 64: 17 MB).
_EXPANDED_BATCH_POSITIONS = 8192
# Query tokens per work item of the expanded kernel (csrc/cpu_mla_prefill.cpp): four vectors
# of 16 lanes, the most its lane kernels hold in registers at once; every (tile, head) is an
# item, so a step's heads alone give the threads work.
_EXPANDED_QUERY_TILE = 64


def _query_tile(max_query_len: int) -> int:
    """The kernel's query_tile for the longest kernel prefill chunk: its register-blocked tiles
    (_GEMM_TILE_FACTOR x query_tile tokens) as long as possible while every thread gets one
    (between 8 and 64 tokens: query_tile 2..16)."""
    threads = max(1, torch.get_num_threads())
    return max(2, min(16, -(-max_query_len // (_GEMM_TILE_FACTOR * threads))))


@dataclass(frozen=True)
class MLACpuStepSplit:
    """A step's rows split between the kernel and the expanded form, for one layer shape.

    Attributes:
        kernel_rows: [R] int32 numpy, the requests the kernel computes (absorbed).
        kernel_tokens: [T] int64, the flat token indices of those requests.
        query_tile: the kernel's `query_tile` for this step.
        expanded_rows: [E] int32 numpy, the prefill requests run in the expanded form through
            the kernel (`_expanded_in_kernel`; empty with `expanded_in_kernel` off).
        expanded_tokens: [T'] int64, the flat token indices of those requests.
        expanded_query_tile: the kernel's `query_tile` for them.
        expanded_groups: torch row groups of the prefill rows run in the expanded form in torch
            (`mla_torch.attend_row_groups`; with `expanded_in_kernel` off).
    """

    kernel_rows: np.ndarray
    kernel_tokens: torch.Tensor
    query_tile: int
    expanded_rows: np.ndarray
    expanded_tokens: torch.Tensor
    expanded_query_tile: int
    expanded_groups: tuple


@dataclass(frozen=True)
class MLACpuMetadata:
    """Per-step inputs, built once and shared by all layers.

    Attributes:
        common: the step's metadata.
        torch_metadata: row groups of every request, for the batch-invariant mode (else None).
        query_start_loc, seq_lens: [num_reqs + 1] / [num_reqs] int32 numpy (kernel inputs).
        prefill_form: "auto" (`mla_torch.prefers_absorbed`), "absorbed" or "expanded" (every
            prefill chunk in that form; decodes are absorbed either way).
        expanded_in_kernel: run the expanded form's attention in the native kernel (True) or
            in torch (`mla_torch.attend_row_groups`, the reference).
        expanded_batch_positions: context positions expanded at a time in the kernel's
            expanded form (`_expanded_in_kernel`).
        splits: the step's `MLACpuStepSplit` per layer shape (dn, dr, dv, L), made on the
            first call of each shape (`split`).
    """

    common: CommonAttentionMetadata
    torch_metadata: TorchSDPAMetadata | None
    query_start_loc: np.ndarray
    seq_lens: np.ndarray
    prefill_form: str = "auto"
    expanded_in_kernel: bool = True
    expanded_batch_positions: int = _EXPANDED_BATCH_POSITIONS
    splits: dict = field(default_factory=dict)

    def split(self, dims: tuple[int, int, int, int]) -> MLACpuStepSplit:
        """The split of this step's rows for a layer of dimensions (dn, dr, dv, L)."""
        found = self.splits.get(dims)
        if found is not None:
            return found
        query_lens = np.diff(self.query_start_loc)
        absorbed = absorbed_rows_mask(query_lens, self.seq_lens, dims, self.prefill_form,
                                      ABSORBED_COST_FACTOR)
        rows = np.nonzero(absorbed)[0].astype(np.int32)
        expanded = np.nonzero(~absorbed)[0].astype(np.int32)
        # The expanded kernel's lanes take value sizes in fours (csrc/cpu_mla_prefill.cpp);
        # builds without it, and the reference setting, run these rows in torch.
        in_kernel = (self.expanded_in_kernel and len(expanded) > 0 and dims[2] % 4 == 0
                     and mla_expanded_prefill_supported())
        found = MLACpuStepSplit(
            rows, _tokens_of(self.query_start_loc, rows),
            _query_tile(int(query_lens[rows].max()) if len(rows) else 1),
            expanded if in_kernel else expanded[:0],
            _tokens_of(self.query_start_loc, expanded if in_kernel else expanded[:0]),
            _EXPANDED_QUERY_TILE,
            (build_row_group(self.common, expanded),)
            if len(expanded) and not in_kernel else ())
        self.splits[dims] = found
        return found


class MLACpuBackend:
    """MLA with the native kernel for decode rows and the prefill chunks the absorbed form
    serves better (module docstring)."""

    name = "mla_cpu_paged"

    @staticmethod
    def is_available() -> bool:
        return cpu_kernels() is not None

    @staticmethod
    def build_metadata(common: CommonAttentionMetadata, prefill_form: str = "auto",
                       expanded_in_kernel: bool = True,
                       expanded_batch_positions: int = _EXPANDED_BATCH_POSITIONS
                       ) -> MLACpuMetadata:
        """The step's kernel inputs; the rows' split is made per layer shape (`split`).

        Args:
            common: the step's metadata.
            prefill_form: one of `mla_torch.PREFILL_FORMS` (tests and benchmarks force a form).
            expanded_in_kernel: False runs the expanded rows in torch (tests and benchmarks).
            expanded_batch_positions: see `MLACpuMetadata` (tests make it small).

        Raises:
            ValueError: for another prefill_form.
        """
        check_prefill_form(MLACpuBackend.name, prefill_form)
        qsl = np.ascontiguousarray(common.query_start_loc_cpu[:common.num_reqs + 1],
                                   dtype=np.int32)
        seq_lens = np.ascontiguousarray(common.seq_lens_cpu[:common.num_reqs], dtype=np.int32)
        torch_metadata = (MLATorchBackend.build_metadata(common) if common.batch_invariant
                          else None)
        return MLACpuMetadata(common, torch_metadata, qsl, seq_lens, prefill_form,
                              expanded_in_kernel, expanded_batch_positions)

    @staticmethod
    def forward(q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor,
                kv_cache: torch.Tensor, metadata: MLACpuMetadata, w_kv_b: torch.Tensor,
                scale: float) -> torch.Tensor:
        """As `MLATorchBackend.forward` (same arguments and result)."""
        if metadata.torch_metadata is not None:
            return MLATorchBackend.forward(q_nope, q_pe, latent, kv_cache,
                                           metadata.torch_metadata, w_kv_b, scale)
        common = metadata.common
        n = common.num_actual_tokens
        write_cache_rows(kv_cache, 0, latent[:n, None], common.slot_mapping[:n])
        num_heads, dn_dv, kv_lora_rank = w_kv_b.shape
        dn, dr = q_nope.shape[-1], q_pe.shape[-1]
        split = metadata.split((dn, dr, dn_dv - dn, kv_lora_rank))
        if len(split.kernel_tokens) == q_nope.shape[0]:
            return _absorbed_in_kernel(q_nope, q_pe, kv_cache, metadata, split, w_kv_b, scale)
        # Every request's tokens are written below (kernel, expanded kernel or torch rows):
        # only the padded tokens past num_actual_tokens need their zeros.
        out = q_nope.new_empty(q_nope.shape[0], num_heads, dn_dv - dn)
        out[n:] = 0
        if len(split.kernel_rows):
            out[split.kernel_tokens] = _absorbed_in_kernel(q_nope, q_pe, kv_cache, metadata,
                                                           split, w_kv_b, scale)
        if len(split.expanded_rows):
            _expanded_in_kernel(out, q_nope, q_pe, latent, kv_cache, metadata, split, w_kv_b,
                                scale)
        attend_row_groups(out, split.expanded_groups, q_nope, q_pe, kv_cache, w_kv_b, scale)
        return out


def _absorbed_in_kernel(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
                        metadata: MLACpuMetadata, split: MLACpuStepSplit, w_kv_b: torch.Tensor,
                        scale: float) -> torch.Tensor:
    """The absorbed form of the kernel rows' tokens: [T, H, dv] in q_nope's dtype."""
    num_heads, dn_dv, kv_lora_rank = w_kv_b.shape
    dn = q_nope.shape[-1]
    tokens = split.kernel_tokens
    w_uk, w_uv = w_kv_b.split([dn, dn_dv - dn], dim=1)
    every_token = len(tokens) == q_nope.shape[0]
    if every_token:
        # Every token is a kernel row's (token t is the t-th; e.g. a decode-only step): no
        # gathers or scatters. NOTE(mla): per-head products as bmm over [H, t, .] views, the
        # same sums as the einsums below at a third of their dispatch cost for a few rows.
        q_lat = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)
        q = torch.cat((q_lat, q_pe), dim=-1).to(torch.float32)
    else:
        # Only the kernel rows' tokens, as a step of their own (`_compact_rows`): a mixed
        # step's few decodes must not cost a [num_tokens, H, L + dr] query and output.
        q_lat = torch.einsum("thd,hdl->thl", q_nope[tokens], w_uk)
        q = torch.cat((q_lat, q_pe[tokens]), dim=-1).float()
    # Key and value caches are the same latent tensor (stride 0 over the K/V axis), and so
    # are an int8 cache's K and V scales.
    one = kv_cache[0]
    kv = one.as_strided((2,) + tuple(one.shape), (0,) + one.stride())
    scales = None
    if is_quantized_kv_cache(kv_cache):
        scales = kv_cache_scales(kv_cache)
        scales = scales.expand((2,) + tuple(scales.shape[1:]))
    if every_token:
        o = paged_attention(q, kv, metadata.common.block_table, metadata.query_start_loc,
                            metadata.seq_lens, split.kernel_rows, scale,
                            query_tile=split.query_tile, checked=False, scales=scales)
        o_lat = o[:, :, :kv_lora_rank].to(q_nope.dtype)
        return torch.bmm(o_lat.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)
    table, qsl, seq_lens, rows = _compact_rows(metadata, split.kernel_rows)
    o = paged_attention(q, kv, table, qsl, seq_lens, rows, scale, query_tile=split.query_tile,
                        checked=False, scales=scales)
    o_lat = o[:, :, :kv_lora_rank].to(q_nope.dtype)
    return torch.einsum("thl,hvl->thv", o_lat, w_uv)


def _compact_rows(metadata: MLACpuMetadata, rows: np.ndarray):
    """The requests `rows` as a step of their own: (block_table [R, max_blocks] int32,
    query_start_loc [R + 1] int32, seq_lens [R] int32, rows [R] int32 = 0..R-1), their tokens
    numbered 0.. in order (as `MLACpuStepSplit.kernel_tokens` lists them)."""
    query_lens = metadata.query_start_loc[rows + 1] - metadata.query_start_loc[rows]
    qsl = np.zeros(len(rows) + 1, dtype=np.int32)
    np.cumsum(query_lens, out=qsl[1:])
    table = metadata.common.block_table[torch.from_numpy(rows.astype(np.int64))].contiguous()
    return (table, qsl, np.ascontiguousarray(metadata.seq_lens[rows]),
            np.arange(len(rows), dtype=np.int32))


def _tokens_of(query_start_loc: np.ndarray, rows: np.ndarray) -> torch.Tensor:
    """[T] int64: the flat token indices of the requests `rows`, in order."""
    if not len(rows):
        return torch.zeros(0, dtype=torch.int64)
    starts, ends = query_start_loc[rows], query_start_loc[rows + 1]
    return torch.from_numpy(np.concatenate([np.arange(a, b) for a, b in zip(starts, ends)])
                            .astype(np.int64))


def _expanded_in_kernel(out: torch.Tensor, q_nope: torch.Tensor, q_pe: torch.Tensor,
                        latent: torch.Tensor, kv_cache: torch.Tensor, metadata: MLACpuMetadata,
                        split: MLACpuStepSplit, w_kv_b: torch.Tensor, scale: float) -> None:
    """The expanded form of the `split.expanded_rows` requests, attention in the native kernel;
    written into `out` [num_tokens, H, dv] at their tokens.

    Each request's context (cached prefix and chunk, already written) is gathered from the
    latent cache a whole block at a time (dequantized to the model dtype, as the torch form
    does) and its c_kv expanded with kv_b_proj in one GEMM, kv_nope [N, H, dn + dv] (the torch
    form's `c_kv @ W_kv_b^T`); `ops.mla_expanded_prefill` then runs causal multi-head
    attention reading the keys [W_UK_h c_kv | k_pe] and values W_UV_h c_kv straight from
    kv_nope and the gathered k_pe, the chunk's query tokens in tiles (csrc/cpu_mla_prefill.cpp).
    Where every expanded request is a fresh prefill (its context is its own new tokens) and
    the cache holds the model dtype, the context is the step's `latent` rows themselves (the
    very values the cache got), and nothing is gathered.

    Requests are taken in batches of at most `metadata.expanded_batch_positions` context
    positions (block-rounded), so kv_nope stays bounded for long prompts (a request longer
    than that is a batch alone).
    """
    common = metadata.common
    num_heads, dn_dv, kv_lora_rank = w_kv_b.shape
    dtype = q_nope.dtype
    bs = common.block_size
    w_flat = w_kv_b.reshape(num_heads * dn_dv, kv_lora_rank)
    rows = split.expanded_rows
    # The kernel writes float32 rows of its requests' tokens only: straight into a float32
    # `out`, else into `o` and converted at those tokens.
    direct = out.dtype == torch.float32 and out.is_contiguous()
    o = out if direct else torch.empty(out.shape, dtype=torch.float32)
    qsl = metadata.query_start_loc
    n = common.num_actual_tokens
    if (kv_cache.dtype == dtype and n <= metadata.expanded_batch_positions
            and np.array_equal(metadata.seq_lens[rows], qsl[rows + 1] - qsl[rows])):
        ctx = latent[:n]
        kv_nope = F.linear(ctx[:, :kv_lora_rank], w_flat).view(-1, num_heads, dn_dv)
        mla_expanded_prefill(q_nope, q_pe, kv_nope, ctx[:, kv_lora_rank:],
                             qsl[:-1].astype(np.int64), qsl, metadata.seq_lens, rows, scale,
                             split.expanded_query_tile, o)
        if not direct:
            _scatter_expanded(out, o, split.expanded_tokens)
        return
    num_blocks = -(-metadata.seq_lens[rows] // bs)
    table_np = common.block_table.cpu().numpy()
    ctx_start = np.zeros(len(metadata.seq_lens), dtype=np.int64)
    begin = 0
    while begin < len(rows):
        end = begin + 1
        total = int(num_blocks[begin])
        while (end < len(rows) and
               (total + num_blocks[end]) * bs <= metadata.expanded_batch_positions):
            total += int(num_blocks[end])
            end += 1
        batch, blocks = rows[begin:end], num_blocks[begin:end]
        # Request batch[i]'s context position c is row first[i] * bs + c of the gathered blocks.
        first = np.concatenate(([0], np.cumsum(blocks)[:-1]))
        ctx_start[batch] = first * bs
        cache_blocks = np.concatenate([table_np[r, :b] for r, b in zip(batch, blocks)])
        slots = (cache_blocks.astype(np.int64)[:, None] * bs + np.arange(bs)).reshape(-1)
        ctx = dequantize_kv(kv_cache, 0, torch.from_numpy(slots), dtype)[:, 0]  # [N, L + dr]
        # NOTE(mla): F.linear, not `c_kv @ w.t()`: with c_kv a strided view of the gathered
        # rows the latter ran at half the GEMM rate (6.6 against 3.3 ms at 4096 x 128 x 512).
        kv_nope = F.linear(ctx[:, :kv_lora_rank], w_flat).view(-1, num_heads, dn_dv)
        mla_expanded_prefill(q_nope, q_pe, kv_nope, ctx[:, kv_lora_rank:], ctx_start,
                             metadata.query_start_loc, metadata.seq_lens,
                             np.ascontiguousarray(batch), scale, split.expanded_query_tile, o)
        begin = end
    if not direct:
        _scatter_expanded(out, o, split.expanded_tokens)


def _scatter_expanded(out: torch.Tensor, o: torch.Tensor, tokens: torch.Tensor) -> None:
    """out[tokens] = o[tokens] (float32 [num_tokens, H, dv] into out's other dtype)."""
    if len(tokens) == out.shape[0]:
        out.copy_(o)
    else:
        out[tokens] = o[tokens].to(out.dtype)
