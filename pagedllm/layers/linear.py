"""Linear layers with tensor-parallel sharding and per-parameter weight loaders.

Column-parallel layers split the output dimension across ranks, row-parallel ones the input
dimension (followed by an all-reduce, visible in `RowParallelLinear.reduce_partial`). Fused layers
(`QKVParallelLinear`, `MergedColumnParallelLinear`) hold several checkpoint tensors in one weight;
their `weight_loader(param, loaded, shard_id)` copies each into its rows.

    QKV weight rows:  [ q: num_heads*head_size | k: num_kv_heads*head_size | v: same as k ]

Each layer's weight is created, loaded and applied by its quantization method (`quant_method`,
layers/quantization/: float weights by default, GGUF blocks after `set_quant_method`); the
layers keep the sharding: which rows of which checkpoint tensor go where.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.distributed.parallel_state import (get_tensor_model_parallel_rank,
                                                 get_tensor_model_parallel_world_size,
                                                 tensor_model_parallel_all_reduce)
from pagedllm.layers.quantization.base import (LinearMethodBase, UnquantizedLinearMethod,
                                               copy_checkpoint_tensor)


def _param(shape: tuple[int, ...], loader) -> nn.Parameter:
    p = nn.Parameter(torch.empty(shape), requires_grad=False)
    p.weight_loader = loader
    return p


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
    """Copy a whole checkpoint tensor into `param` (shapes must match).

    `loaded` may be a lazy checkpoint tensor (`model_loader.loader.CheckpointTensor`: `shape`,
    `narrow`, `materialize`); it is read from disk here, after the sharding loaders narrowed it
    to this rank's slice.

    Raises:
        ValueError: on a shape mismatch, naming both shapes.
    """
    copy_checkpoint_tensor(param, loaded)


def shard_of(loaded, dim: int, full_size: int, rank: int, size: int):
    """Entries [rank * size, (rank + 1) * size) along `dim` of a checkpoint tensor (or lazy
    checkpoint tensor) whose `dim` must have the layer's unsharded size `full_size`.

    Narrowing alone would accept a checkpoint tensor larger than the config says (a
    `qk_nope_head_dim` or `intermediate_size` smaller than the weights) and silently load a
    part of it; this refuses it.

    Raises:
        ValueError: `loaded.shape[dim] != full_size`, naming both sizes.
    """
    if loaded.shape[dim] != full_size:
        raise ValueError(f"shape mismatch: checkpoint {tuple(loaded.shape)} has "
                         f"{loaded.shape[dim]} along dim {dim}, the model config gives "
                         f"{full_size}")
    return loaded.narrow(dim, rank * size, size)


def _set_quant_method(layer: nn.Module, method: LinearMethodBase) -> None:
    """Make `method` create (empty) and apply `layer`'s weight; the bias is unchanged."""
    layer.quant_method = method
    method.create_weights(layer, layer.input_size_per_partition,
                          layer.output_size_per_partition, layer.weight_loader)


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with W split by output rows across tensor-parallel ranks.

    Args:
        input_size, output_size: full (unsharded) sizes.
        bias: add a bias.
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__()
        self.tp_rank = get_tensor_model_parallel_rank()
        self.tp_size = get_tensor_model_parallel_world_size()
        if output_size % self.tp_size:
            raise ValueError(f"output size {output_size} not divisible by tp size {self.tp_size}")
        self.output_size_per_partition = output_size // self.tp_size
        self.input_size_per_partition = input_size
        _set_quant_method(self, UnquantizedLinearMethod())
        self.bias = _param((self.output_size_per_partition,), self.weight_loader) if bias else None

    def set_quant_method(self, method: LinearMethodBase) -> None:
        """Store and apply the weight with `method` (re-created empty; load afterwards)."""
        _set_quant_method(self, method)

    def _load_rows(self, param: nn.Parameter, part, offset: int | None) -> None:
        """`part` (this rank's rows of a checkpoint tensor) into rows [offset, ...) of `param`
        (None: all of it), through the quantization method for the weight."""
        if param is self.weight:
            self.quant_method.load_weight(self, part, offset)
        else:
            default_weight_loader(param if offset is None else
                                  param.data.narrow(0, offset, part.shape[0]), part)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        shard = self.output_size_per_partition
        self._load_rows(param, shard_of(loaded, 0, shard * self.tp_size, self.tp_rank, shard),
                        None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input in one weight (e.g. gate_up_proj).

    Args:
        output_sizes: full output size of each merged projection, in order.
    """

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False) -> None:
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: int | None = None) -> None:
        if shard_id is None:
            raise ValueError("merged linear layers need a shard id for each checkpoint tensor")
        size = self.output_sizes[shard_id] // self.tp_size
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        self._load_rows(param, shard_of(loaded, 0, self.output_sizes[shard_id], self.tp_rank,
                                        size), offset)


class QKVParallelLinear(ColumnParallelLinear):
    """Fused Q, K and V projections; KV heads are replicated when fewer than ranks."""

    def __init__(self, hidden_size: int, head_size: int, total_num_heads: int,
                 total_num_kv_heads: int, bias: bool = False) -> None:
        tp_size = get_tensor_model_parallel_world_size()
        if total_num_heads % tp_size:
            raise ValueError(f"{total_num_heads} attention heads not divisible by tp {tp_size}")
        if total_num_kv_heads % tp_size and tp_size % total_num_kv_heads:
            raise ValueError(f"{total_num_kv_heads} KV heads neither divisible by nor dividing "
                             f"tp {tp_size}")
        self.head_size = head_size
        self.num_heads = total_num_heads // tp_size
        self.num_kv_heads = max(1, total_num_kv_heads // tp_size)
        self.num_kv_head_replicas = max(1, tp_size // total_num_kv_heads)
        out = (self.num_heads + 2 * self.num_kv_heads) * head_size * tp_size
        super().__init__(hidden_size, out, bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: str | None = None) -> None:
        q_size = self.num_heads * self.head_size
        kv_size = self.num_kv_heads * self.head_size
        kv_ranks = self.tp_size // self.num_kv_head_replicas   # ranks holding distinct KV heads
        offset, size, rank, full = {
            "q": (0, q_size, self.tp_rank, q_size * self.tp_size),
            "k": (q_size, kv_size, self.tp_rank // self.num_kv_head_replicas, kv_size * kv_ranks),
            "v": (q_size + kv_size, kv_size, self.tp_rank // self.num_kv_head_replicas,
                  kv_size * kv_ranks)}[shard_id]
        self._load_rows(param, shard_of(loaded, 0, full, rank, size), offset)


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_shard W_shard^T) + b with W split by input columns across ranks."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__()
        self.tp_rank = get_tensor_model_parallel_rank()
        self.tp_size = get_tensor_model_parallel_world_size()
        if input_size % self.tp_size:
            raise ValueError(f"input size {input_size} not divisible by tp size {self.tp_size}")
        self.input_size_per_partition = input_size // self.tp_size
        self.output_size_per_partition = output_size
        _set_quant_method(self, UnquantizedLinearMethod())
        self.bias = _param((output_size,), default_weight_loader) if bias else None

    def set_quant_method(self, method: LinearMethodBase) -> None:
        """Store and apply the weight with `method` (re-created empty; load afterwards)."""
        _set_quant_method(self, method)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        shard = self.input_size_per_partition
        part = shard_of(loaded, 1, shard * self.tp_size, self.tp_rank, shard)
        if param is self.weight:
            self.quant_method.load_weight(self, part, None)
        else:
            default_weight_loader(param, part)

    def forward_partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's partial sum x_shard W_shard^T [n, output_size] (x: [n,
        input_size_per_partition]), before the all-reduce and without the bias. A wrapper may
        add its own partial sums to it (LoRA, lora/layers.py) so they are reduced once."""
        return self.quant_method.apply(self, x)

    def reduce_partial(self, y: torch.Tensor) -> torch.Tensor:
        """Sum the ranks' partial outputs `y` [n, output_size] (all-reduce) and add the bias."""
        if self.tp_size > 1:
            y = tensor_model_parallel_all_reduce(y)
        if self.bias is not None:
            y = y + self.bias
        return y

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            # NOTE(row-bias): one rank has no partial sums to reduce, so the bias goes into the
            # GEMM (added to its float32 accumulators), not through a second pass over the
            # output: float32 gives the same bits; bfloat16 rounds once instead of twice.
            return self.quant_method.apply(self, x, self.bias)
        return self.reduce_partial(self.forward_partial(x))
