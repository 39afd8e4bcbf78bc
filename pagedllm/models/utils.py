"""Helpers shared by the model families."""

from __future__ import annotations

from torch import nn

from pagedllm.layers.linear import default_weight_loader
from pagedllm.layers.pipeline import MissingLMHead, PPMissingLayer
from pagedllm.layers.vocab_embedding import LMHead

# (our fused parameter, checkpoint name, shard id)
StackedParamsMapping = tuple[tuple[str, str, str | int], ...]


def make_lm_head(config, model: nn.Module, tie_word_embeddings: bool) -> nn.Module:
    """The LM head of a decoder stack `model` (with `.pp` and `.embed_tokens`): a placeholder on
    stages before the last; tied to the embedding when both are on this stage (a last stage that
    is not also the first holds its own copy of a tied embedding)."""
    if not model.pp.is_last_rank:
        return MissingLMHead(config.vocab_size)
    tie = tie_word_embeddings and model.pp.is_first_rank
    return LMHead(config.vocab_size, config.hidden_size,
                  tie_to=model.embed_tokens if tie else None)


def load_named_weight(params: dict[str, nn.Parameter], name: str, tensor,
                      stacked_params_mapping: StackedParamsMapping = ()) -> str:
    """Load one checkpoint tensor into its parameter through the parameter's weight_loader; a
    tensor of a fused parameter (e.g. q_proj into qkv_proj) goes in with its shard id.

    Returns:
        The name of the parameter that was (partly) set.

    Raises:
        ValueError: if no parameter matches the tensor's name, or the parameter's loader
            refuses the tensor (a shape mismatch), naming the tensor.
    """
    for param_name, ckpt_name, shard_id in stacked_params_mapping:
        if f".{ckpt_name}." in name:
            target = name.replace(f".{ckpt_name}.", f".{param_name}.")
            param = params.get(target)
            if param is None:
                raise ValueError(f"checkpoint tensor {name} has no matching parameter")
            call_weight_loader(name, param.weight_loader, param, tensor, shard_id)
            return target
    param = params.get(name)
    if param is None:
        raise ValueError(f"checkpoint tensor {name} has no matching parameter")
    call_weight_loader(name, getattr(param, "weight_loader", default_weight_loader), param, tensor)
    return name


def call_weight_loader(name: str, loader, *args) -> None:
    """`loader(*args)` for checkpoint tensor `name`, its ValueError (a shape mismatch)
    prefixed with the name; subclasses (`GGUFLayoutUnsupported`, which the loader catches to
    fall back) pass as they are."""
    try:
        loader(*args)
    except ValueError as e:
        if type(e) is not ValueError:
            raise
        raise ValueError(f"checkpoint tensor {name}: {e}") from e


def load_fused_qkv_weight(params: dict[str, nn.Parameter], name: str, tensor) -> str:
    """Load a checkpoint's fused `qkv` tensor of multi-head attention with q, k and v of equal
    width (a ViT's `attn.qkv`: rows [q | k | v], [3 * H * D] or [3 * H * D, in]) into the
    `QKVParallelLinear` parameter `name`, shard by shard (so tensor parallelism splits each).

    Returns:
        `name`.

    Raises:
        ValueError: if no parameter is named `name`, or the rows do not split in three.
    """
    param = params.get(name)
    if param is None:
        raise ValueError(f"checkpoint tensor {name} has no matching parameter")
    if tensor.shape[0] % 3:
        raise ValueError(f"checkpoint tensor {name} has {tensor.shape[0]} rows, not three equal "
                         f"q, k, v parts")
    for shard, part in zip("qkv", tensor.chunk(3, dim=0)):
        param.weight_loader(param, part, shard)
    return name


def load_causal_lm_weights(model: nn.Module, weights, stacked_params_mapping: StackedParamsMapping,
                           tie_word_embeddings: bool) -> set[str]:
    """Load HF-named checkpoint tensors into a decoder-only causal LM laid out as
    `model.{embed_tokens,layers.N.*,norm}` + `lm_head` (pipeline stages hold `PPMissingLayer`s
    for the modules of other stages; their tensors are skipped).

    Skips `rotary_emb.inv_freq` buffers and, with tied embeddings, `lm_head.weight`; a last
    pipeline stage that does not hold the embedding loads its own copy of it into `lm_head`.

    Returns:
        The names of the parameters that were (partly) set.

    Raises:
        ValueError: for a tensor whose name matches no parameter, or a shape mismatch.
    """
    params = dict(model.named_parameters())
    elsewhere = tuple(f"{n}." for n, m in model.named_modules() if isinstance(m, PPMissingLayer))
    loaded: set[str] = set()
    for name, tensor in weights:
        if "rotary_emb.inv_freq" in name:
            continue
        if name == "lm_head.weight" and tie_word_embeddings:
            continue
        if (name == "model.embed_tokens.weight" and tie_word_embeddings
                and "lm_head.weight" in params):
            # Pipeline parallelism: the last stage's untied copy of the embedding.
            lm_head = params["lm_head.weight"]
            lm_head.weight_loader(lm_head, tensor)
            loaded.add("lm_head.weight")
        if name.startswith(elsewhere):
            continue
        loaded.add(load_named_weight(params, name, tensor, stacked_params_mapping))
    return loaded
