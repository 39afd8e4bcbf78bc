"""Helpers shared by the model families."""

from __future__ import annotations

from torch import nn

from pagedllm.layers.linear import default_weight_loader

# (our fused parameter, checkpoint name, shard id)
StackedParamsMapping = tuple[tuple[str, str, str | int], ...]


def load_named_weight(params: dict[str, nn.Parameter], name: str, tensor,
                      stacked_params_mapping: StackedParamsMapping = ()) -> str:
    """Load one checkpoint tensor into its parameter through the parameter's weight_loader; a
    tensor of a fused parameter (e.g. q_proj into qkv_proj) goes in with its shard id.

    Returns:
        The name of the parameter that was (partly) set.

    Raises:
        ValueError: if no parameter matches the tensor's name.
    """
    for param_name, ckpt_name, shard_id in stacked_params_mapping:
        if f".{ckpt_name}." in name:
            target = name.replace(f".{ckpt_name}.", f".{param_name}.")
            param = params.get(target)
            if param is None:
                raise ValueError(f"checkpoint tensor {name} has no matching parameter")
            param.weight_loader(param, tensor, shard_id)
            return target
    param = params.get(name)
    if param is None:
        raise ValueError(f"checkpoint tensor {name} has no matching parameter")
    getattr(param, "weight_loader", default_weight_loader)(param, tensor)
    return name
