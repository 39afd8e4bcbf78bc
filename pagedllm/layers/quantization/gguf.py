"""Linear layers whose weights stay in a GGUF file's block formats (llama.cpp's Q8_0, Q4_0, Q4_1,
Q5_0, Q5_1 and the K-quants Q4_K, Q5_K, Q6_K).

    GGUF file ──(GGUFTensor.materialize_raw: rows of blocks, TP slice)──► layer.weight
    apply: gguf_linear (pagedllm/native/kernels/csrc/cpu_gguf_linear.cpp) unpacks blocks in registers

A fused layer (qkv, gate_up) holds several checkpoint tensors, and a Q4_K_M file gives them
different types (attn_v in Q6_K next to Q4_K attn_q/attn_k). The weight is therefore a list of
row segments, one per loaded tensor, each in its own type (`layer.gguf_segments`):

    one type:    layer.weight [output_size_per_partition, row_bytes] uint8 (the usual matrix)
    mixed types: layer.weight [total_bytes] uint8, the segments' [rows, row_bytes_i] blocks
                 back to back in row order (no padding)

and a fused layer of mixed types runs one native call that writes each segment's output
columns. Once loaded (`process_weights_after_loading`), each segment's bytes are put in the
kernels' row-group layout (`gguf_group_rows`: the blocks of 4 consecutive rows interleaved, so
a batch-1 GEMV reads one sequential stream, which the hardware prefetcher follows: faster, as
llama.cpp's load-time repacking; docs/benchmarks.md, "Measurements behind choices in the code");
`PAGEDLLM_GGUF_ROW_GROUPS=0` keeps the file's plain rows.

Activations: each linear (and the quantized LM head) rounds its input to 8 bits per 32-value
block (per 256 values for the K-quants) and runs integer dot products (`gguf_linear(..., quantize_activations=True)`,
csrc/gguf_q8_dot.h), as llama.cpp does: faster than unpacking every weight to float32, at
batch 1 and batched (docs/benchmarks.md, "Measurements behind choices in the code"), and the
perplexity moves by less than 0.1% (docs/benchmarks.md). `PAGEDLLM_GGUF_Q8_ACTIVATIONS=0` keeps
float32 activations, exact up to the order of the sums (the tests' oracle mode). The fused CPU
decoder follows each method's choice. Blocks run along the input dimension, so splitting the output rows across
tensor-parallel ranks is exact, and splitting the input dimension must fall on block boundaries
(refused otherwise). `GGUFEmbeddingMethod` keeps the token embedding / tied LM head in blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pagedllm.native.kernels.quantized_ops import (GGUF_BLOCK_SIZE, GGUF_KERNEL_TYPES, gguf_dequantize_rows,
                                         gguf_group_rows, gguf_linear, gguf_linear_segments,
                                         gguf_ungroup_rows)
from pagedllm.layers.quantization.base import LinearMethodBase
from pagedllm.platforms import current_platform


Q8_ACTIVATIONS_ENV = "PAGEDLLM_GGUF_Q8_ACTIVATIONS"
ROW_GROUPS_ENV = "PAGEDLLM_GGUF_ROW_GROUPS"


def gguf_q8_activations_enabled() -> bool:
    """The default of GGUF layers' 8-bit activations: on unless `PAGEDLLM_GGUF_Q8_ACTIVATIONS`
    is 0/false/off/no (`current_platform.options`, read at engine start; asked when a method
    is built, i.e. at model construction)."""
    return current_platform.options.gguf_q8_activations


def gguf_row_groups_enabled() -> bool:
    """Whether loaded GGUF weights on the CPU go to the kernels' row-group layout: yes unless
    `PAGEDLLM_GGUF_ROW_GROUPS` is 0/false/off/no (`current_platform.options`: read and
    validated at engine start, so a typo fails before any weight is loaded)."""
    return current_platform.options.gguf_row_groups


class GGUFLayoutUnsupported(ValueError):
    """A GGUF checkpoint's linear weights cannot stay quantized (a tensor type without a kernel);
    the checkpoint still loads dequantized."""


@dataclass(frozen=True)
class GGUFSegment:
    """Rows [row_start, row_start + rows) of a quantized weight, in GGML type `tensor_type`,
    stored from byte `byte_offset` of the layer's weight buffer as [rows, row_bytes] blocks."""

    row_start: int
    rows: int
    tensor_type: str
    row_bytes: int
    byte_offset: int = 0


def gguf_row_bytes(tensor_type: str, input_size: int) -> int:
    """Bytes per weight row of `input_size` weights in `tensor_type` (a GGUF_KERNEL_TYPES name)."""
    block = GGUF_KERNEL_TYPES[tensor_type]
    return input_size // block.block_weights * block.block_bytes


class GGUFLinearMethod(LinearMethodBase):
    """Keeps a linear layer's weight as raw GGUF blocks and computes on them natively (CPU).

    After loading, `layer.weight` holds the blocks (see the module docstring for the two
    layouts), `layer.gguf_segments` the loaded row segments in row order,
    `layer.gguf_quant_type` the GGML type name when all segments share one (None when mixed),
    and `layer.gguf_grouped` whether the segments' bytes are in the row-group layout (after
    `process_weights_after_loading`); the bias (if any) stays float.

    Args:
        quantize_activations: round the input to 8 bits per 32-value block and use integer dot
            products (see the module docstring); None: `gguf_q8_activations_enabled()`.
    """

    quantized = True

    def __init__(self, quantize_activations: bool | None = None) -> None:
        self.quantize_activations = (gguf_q8_activations_enabled() if quantize_activations is None
                                     else quantize_activations)
        self.group_rows = gguf_row_groups_enabled()

    def batch_invariant(self, layer: nn.Module) -> bool:
        """The 8-bit-activation kernels only: x is rounded per row and block, integer block
        sums are exact, and each row's float sums run in one order at every row count; the
        float-activation kernels' batch-1 GEMV sums in two chains where their row tiles use
        one."""
        return self.quantize_activations

    def create_weights(self, layer: nn.Module, input_size_per_partition: int,
                       output_size_per_partition: int, weight_loader) -> None:
        if input_size_per_partition % GGUF_BLOCK_SIZE:
            # (GGUFLayoutUnsupported: the default quantization then dequantizes the file, e.g.
            # a DeepSeek q_b_proj over a q_lora_rank of 24, which the converter stores in F16)
            raise GGUFLayoutUnsupported(
                f"{type(layer).__name__}: an input shard of {input_size_per_partition} columns "
                f"does not fall on {GGUF_BLOCK_SIZE}-weight GGUF block boundaries (with tensor "
                f"parallelism, the row-parallel input split must); use quantization='none' or "
                f"another tensor_parallel_size")
        device = layer.weight.device if isinstance(getattr(layer, "weight", None),
                                                   torch.Tensor) else None
        weight = nn.UninitializedParameter(requires_grad=False, device=device)
        weight.weight_loader = weight_loader
        layer.weight = weight
        layer.gguf_quant_type = None
        layer.gguf_segments = ()
        layer.gguf_grouped = False
        layer._gguf_kernel_segments = None
        layer.input_size_per_partition = input_size_per_partition
        layer.output_size_per_partition = output_size_per_partition

    def load_weight(self, layer: nn.Module, loaded, row_offset: int | None) -> None:
        tensor_type = getattr(loaded, "tensor_type", None)
        name = getattr(loaded, "name", "?")
        if tensor_type is None or not hasattr(loaded, "materialize_raw"):
            raise ValueError(f"{type(layer).__name__} with GGUF quantization takes GGUF "
                             f"checkpoint tensors, got {type(loaded).__name__}")
        if tensor_type not in GGUF_KERNEL_TYPES:
            raise GGUFLayoutUnsupported(
                f"GGUF tensor {name} is {tensor_type}; quantized linear layers take "
                f"{', '.join(GGUF_KERNEL_TYPES)} (use quantization='none' to dequantize)")
        k = layer.input_size_per_partition
        if tuple(loaded.shape[1:]) != (k,):
            raise ValueError(f"shape mismatch: GGUF tensor {name} {tuple(loaded.shape)} vs a "
                             f"shard of {k} input columns")
        block_weights = GGUF_KERNEL_TYPES[tensor_type].block_weights
        if k % block_weights:
            raise GGUFLayoutUnsupported(
                f"GGUF tensor {name} is {tensor_type}, whose {block_weights}-weight blocks do "
                f"not divide an input shard of {k} columns (use quantization='none')")
        rows, start = loaded.shape[0], 0 if row_offset is None else row_offset
        out = layer.output_size_per_partition
        if row_offset is None and rows != out or start + rows > out:
            raise ValueError(f"shape mismatch: GGUF tensor {name} has {rows} rows for rows "
                             f"[{start}, {start + rows}) of a {out}-row weight")
        new = GGUFSegment(start, rows, tensor_type, gguf_row_bytes(tensor_type, k))
        kept = [s for s in layer.gguf_segments
                if not (s.row_start == start and s.rows == rows)]   # a reload replaces
        for s in kept:
            if s.row_start < start + rows and start < s.row_start + s.rows:
                raise ValueError(f"GGUF tensor {name} loads rows [{start}, {start + rows}), "
                                 f"overlapping rows [{s.row_start}, {s.row_start + s.rows}) "
                                 f"loaded before")
        try:
            raw = loaded.materialize_raw()
        except ValueError as e:   # e.g. a map that moves columns within blocks (qwen35's ssm_out)
            raise GGUFLayoutUnsupported(str(e)) from e
        if layer.gguf_grouped:   # a reload: back to plain rows (regrouped after loading)
            self._regroup(layer, gguf_ungroup_rows)
        weight = layer.weight
        if isinstance(weight, nn.UninitializedParameter):
            weight.materialize((out, new.row_bytes), dtype=torch.uint8)
        elif not kept:
            weight.data = torch.empty(out, new.row_bytes, dtype=torch.uint8)
        if all(s.tensor_type == tensor_type for s in kept) and weight.dim() == 2:
            # One type so far: the [out, row_bytes] matrix, rows copied in place.
            weight.data.narrow(0, start, rows).copy_(raw)
            layer.gguf_segments = tuple(sorted(kept + [new], key=lambda s: s.row_start))
            layer.gguf_quant_type = tensor_type
        else:
            self._repack_mixed(layer, kept, new, raw)
        layer._gguf_kernel_segments = None

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Put each segment's bytes in the kernels' row-group layout (see the module
        docstring; in place, one segment's size of transient memory). Idempotent."""
        if not layer.gguf_grouped and self.group_rows and layer.weight.device.type == "cpu":
            self._regroup(layer, gguf_group_rows)

    @staticmethod
    def _regroup(layer: nn.Module, convert) -> None:
        """Rewrite every segment's bytes with `convert` (`gguf_group_rows` or its inverse)."""
        for s in layer.gguf_segments:
            data = _segment_bytes(layer, s)
            data.copy_(convert(data, s.tensor_type))
        layer.gguf_grouped = convert is gguf_group_rows
        layer._gguf_kernel_segments = None

    @staticmethod
    def _repack_mixed(layer: nn.Module, kept: list[GGUFSegment], new: GGUFSegment,
                      raw: torch.Tensor) -> None:
        """Rebuild `layer.weight` as the flat buffer of the mixed layout with `new` added (the
        parameter object stays, only its data is replaced)."""
        pieces = [(s, _segment_bytes(layer, s)) for s in kept] + [(new, raw)]
        pieces.sort(key=lambda p: p[0].row_start)
        offset, segments = 0, []
        for s, data in pieces:
            segments.append(GGUFSegment(s.row_start, s.rows, s.tensor_type, s.row_bytes, offset))
            offset += s.rows * s.row_bytes
        layer.weight.data = torch.cat([data.reshape(-1) for _, data in pieces])
        layer.gguf_segments = tuple(segments)
        layer.gguf_quant_type = None

    def kernel_segments(self, layer: nn.Module) -> list[tuple[int, str, torch.Tensor, bool]]:
        """The weight as (row_start, GGML type name, qweight [rows, row_bytes] uint8 view,
        grouped) per segment, for `gguf_linear_segments` and the fused CPU decoder
        (native/fused_decoder.py), which take these in one native call. Cached until the next
        load.

        Raises:
            ValueError: the loaded segments do not cover all output rows (a missing tensor).
        """
        cached = getattr(layer, "_gguf_kernel_segments", None)
        if cached is not None:
            return cached
        covered = 0
        for s in layer.gguf_segments:
            if s.row_start != covered:
                break
            covered += s.rows
        if covered != layer.output_size_per_partition:
            raise ValueError(f"{type(layer).__name__}: GGUF rows loaded "
                             f"{[(s.row_start, s.row_start + s.rows) for s in layer.gguf_segments]}"
                             f" do not cover its {layer.output_size_per_partition} output rows")
        grouped = layer.gguf_grouped
        if layer.gguf_quant_type is not None and not grouped:  # one type: the whole matrix
            segments = [(0, layer.gguf_quant_type, layer.weight.data, False)]
        else:   # (grouped: each segment has its own groups and plain tail rows)
            segments = [(s.row_start, s.tensor_type, _segment_bytes(layer, s), grouped)
                        for s in layer.gguf_segments]
        layer._gguf_kernel_segments = segments
        return segments

    def apply(self, layer: nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        segments = layer._gguf_kernel_segments or self.kernel_segments(layer)
        if len(segments) == 1:
            _, tensor_type, qweight, grouped = segments[0]
            return gguf_linear(x, qweight, tensor_type, bias, self.quantize_activations, grouped)
        return gguf_linear_segments(x, segments, layer.output_size_per_partition, bias,
                                    self.quantize_activations)


def _segment_bytes(layer: nn.Module, s: GGUFSegment) -> torch.Tensor:
    """Segment `s` of `layer.weight` as a [rows, row_bytes] uint8 view, in either layout."""
    weight = layer.weight.data
    if weight.dim() == 2:
        return weight.narrow(0, s.row_start, s.rows)
    return weight.narrow(0, s.byte_offset, s.rows * s.row_bytes).view(s.rows, s.row_bytes)


class GGUFEmbeddingMethod:
    """Keeps a token embedding (and the LM head tied to it) as GGUF blocks: a lookup dequantizes
    only the selected rows, the LM head runs `gguf_linear` (llama.cpp keeps `token_embd` in its
    file type too). A type without a kernel loads dequantized into a float weight instead.

    One object serves the embedding and a tied LM head (`VocabEmbedding.tie_embedding_method`),
    so the state lives here: `tensor_type` (None: float weight), the float `dtype`, and
    `grouped` (the blocks in the kernels' row-group layout, after
    `process_weights_after_loading`).

    Args:
        quantize_activations: the LM head's input rounded to 8 bits per block, as
            `GGUFLinearMethod`'s (None: `gguf_q8_activations_enabled()`); the lookup is exact.
    """

    def __init__(self, quantize_activations: bool | None = None) -> None:
        self.tensor_type: str | None = None
        self.dtype = torch.get_default_dtype()
        self.grouped = False
        self.quantize_activations = (gguf_q8_activations_enabled() if quantize_activations is None
                                     else quantize_activations)
        self.group_rows = gguf_row_groups_enabled()

    def create_weights(self, layer: nn.Module, embedding_dim: int, num_rows: int,
                       weight_loader) -> None:
        """Replace `layer.weight` by an empty parameter for [num_rows, embedding_dim] rows."""
        self.dtype = layer.weight.dtype
        weight = nn.UninitializedParameter(requires_grad=False, device=layer.weight.device)
        weight.weight_loader = weight_loader
        layer.weight = weight
        layer.embedding_dim = embedding_dim

    def load_weight(self, layer: nn.Module, loaded) -> None:
        """Load a whole checkpoint tensor [num_rows, embedding_dim] (already narrowed).

        Raises:
            ValueError: a shape mismatch or a tensor that is not a GGUF tensor.
        """
        if tuple(loaded.shape) != (loaded.shape[0], layer.embedding_dim):
            raise ValueError(f"shape mismatch: embedding of dim {layer.embedding_dim} vs "
                             f"checkpoint {tuple(loaded.shape)}")
        tensor_type = getattr(loaded, "tensor_type", None)
        if not hasattr(loaded, "materialize_raw"):
            raise ValueError(f"GGUF embeddings take GGUF checkpoint tensors, got "
                             f"{type(loaded).__name__}")
        block = GGUF_KERNEL_TYPES.get(tensor_type)
        weight = layer.weight
        if block is None or layer.embedding_dim % block.block_weights:
            data, self.tensor_type = loaded.materialize().to(self.dtype), None
        else:
            data, self.tensor_type = loaded.materialize_raw(), tensor_type
        if isinstance(weight, nn.UninitializedParameter):
            weight.materialize(tuple(data.shape), dtype=data.dtype)
        else:
            weight.data = torch.empty_like(data)
        weight.data.copy_(data)
        self.grouped = False

    def batch_invariant(self, layer: nn.Module) -> bool:
        """Whether the LM head's logits keep the batch-invariant mode: quantized rows on the
        8-bit-activation kernels (as `GGUFLinearMethod.batch_invariant`)."""
        return self.tensor_type is not None and self.quantize_activations

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Put quantized rows in the kernels' row-group layout (as `GGUFLinearMethod`'s).
        Idempotent: a tied LM head calls it again on the same weight."""
        if self.tensor_type is not None and not self.grouped \
                and self.group_rows and layer.weight.device.type == "cpu":
            layer.weight.data.copy_(gguf_group_rows(layer.weight.data, self.tensor_type))
            self.grouped = True

    def embedding(self, layer: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [n] -> [n, embedding_dim] in the float dtype."""
        if self.tensor_type is None:
            return torch.nn.functional.embedding(input_ids, layer.weight)
        return gguf_dequantize_rows(layer.weight, self.tensor_type, input_ids,
                                    layer.embedding_dim, self.grouped).to(self.dtype)

    def logits(self, layer: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [n, embedding_dim] -> [n, num_rows] float32 logits."""
        if self.tensor_type is None:
            return current_platform.linear(hidden, layer.weight, out_dtype=torch.float32)
        return gguf_linear(hidden.float(), layer.weight, self.tensor_type,
                           quantize_activations=self.quantize_activations,
                           grouped=self.grouped)
