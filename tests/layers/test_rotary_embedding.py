"""RoPE tables against transformers' own rotary embeddings (`modeling_rope_utils`): every scaling
the engine implements, at positions on both sides of the original context length."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, Phi3Config
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

from pagedllm.layers.rotary_embedding import (RotaryEmbedding, check_rope_freq_factors,
                                              rope_parameters_from_hf, scaled_inv_freq)
from tests.fixtures.gguf_files import llama_cpp_rope_factors

MAX_POSITION = 512
LLAMA3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


def _hf_cos_sin(rotary, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.zeros(1, dtype=torch.float32)
    cos, sin = rotary(x, positions[None])
    half = cos.shape[-1] // 2
    return cos[0, :, :half], sin[0, :, :half]


@pytest.mark.parametrize("rope", [{"rope_type": "default", "rope_theta": 10000.0},
                                  {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
                                  LLAMA3])
def test_llama_scalings_match_hf(rope):
    config = LlamaConfig(hidden_size=128, num_attention_heads=4,
                         max_position_embeddings=MAX_POSITION, rope_parameters=dict(rope))
    ours = RotaryEmbedding(32, MAX_POSITION, rope_parameters_from_hf(config.to_dict()))
    positions = torch.arange(MAX_POSITION)
    cos, sin = _hf_cos_sin(LlamaRotaryEmbedding(config), positions)
    torch.testing.assert_close(ours.cos_cache, cos, atol=1e-5, rtol=0)
    torch.testing.assert_close(ours.sin_cache, sin, atol=1e-5, rtol=0)


def _phi3_config(partial_rotary_factor: float = 1.0, factor=None) -> Phi3Config:
    half = int(32 * partial_rotary_factor) // 2
    rope = {"rope_type": "longrope", "rope_theta": 10000.0,
            "short_factor": [1.0 + 0.1 * i for i in range(half)],
            "long_factor": [2.0 + 0.5 * i for i in range(half)],
            "original_max_position_embeddings": 64}
    if factor is not None:
        rope["factor"] = factor
    return Phi3Config(hidden_size=128, num_attention_heads=4, num_key_value_heads=4,
                      max_position_embeddings=MAX_POSITION, original_max_position_embeddings=64,
                      partial_rotary_factor=partial_rotary_factor, rope_parameters=rope,
                      pad_token_id=0)


@pytest.mark.parametrize("partial_rotary_factor, factor", [(1.0, None), (0.5, None), (1.0, 3.0)])
def test_longrope_short_and_long_tables_match_hf(partial_rotary_factor, factor):
    """HF picks the short factors while the longest position of a forward is below
    original_max_position_embeddings and the long ones past it; the attention factor scales
    both. Our two tables must equal HF's cos/sin in each regime."""
    config = _phi3_config(partial_rotary_factor, factor)
    ours = RotaryEmbedding(32, MAX_POSITION, rope_parameters_from_hf(config.to_dict()))
    assert ours.rotary_dim == int(32 * partial_rotary_factor)
    assert ours.original_max_position == 64 and ours.long_position_offset == MAX_POSITION
    hf = Phi3RotaryEmbedding(config)
    short = torch.arange(64)
    cos, sin = _hf_cos_sin(hf, short)
    torch.testing.assert_close(ours.cos_cache[short], cos, atol=1e-5, rtol=0)
    torch.testing.assert_close(ours.sin_cache[short], sin, atol=1e-5, rtol=0)
    full = torch.arange(MAX_POSITION)    # longest position past 64: HF uses the long factors
    cos, sin = _hf_cos_sin(hf, full)
    torch.testing.assert_close(ours.cos_cache[full + MAX_POSITION], cos, atol=1e-5, rtol=0)
    torch.testing.assert_close(ours.sin_cache[full + MAX_POSITION], sin, atol=1e-5, rtol=0)


def test_su_is_longrope_and_unknown_types_are_named():
    assert rope_parameters_from_hf({"rope_scaling": {"type": "su", "short_factor": [1.0],
                                                     "long_factor": [1.0]},
                                    "original_max_position_embeddings": 4,
                                    "max_position_embeddings": 8})["rope_type"] == "longrope"
    with pytest.raises(ValueError, match="unsupported rope type 'yarn'"):
        rope_parameters_from_hf({"rope_scaling": {"rope_type": "yarn", "factor": 2.0}})


@pytest.mark.parametrize("hf", [
    {"partial_rotary_factor": 1.5}, {"partial_rotary_factor": -0.5},
    {"partial_rotary_factor": "half"},
    {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 1.5}},
    {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0}},
])
def test_partial_rotary_factor_outside_unit_interval_is_named(hf):
    # 1.5 once built a RoPE over 24 channels of a 16-channel head and ran (HF fails in forward).
    with pytest.raises(ValueError, match="partial_rotary_factor must be a number in"):
        rope_parameters_from_hf(hf)


def test_partial_rotary_factor_inside_unit_interval_is_kept():
    assert rope_parameters_from_hf({"partial_rotary_factor": 0.25})["partial_rotary_factor"] == 0.25
    assert rope_parameters_from_hf({})["partial_rotary_factor"] == 1.0


def test_llama_cpp_rope_freqs_equal_our_llama3_scaling():
    rope = rope_parameters_from_hf({"rope_parameters": dict(LLAMA3)})
    factors = llama_cpp_rope_factors(LLAMA3, 32)
    assert (factors == 1.0).any() and (factors == 8.0).any()    # all three bands are present
    check_rope_freq_factors(factors, 32, rope)
    check_rope_freq_factors(factors.to(torch.bfloat16), 32, rope)
    assert torch.allclose(scaled_inv_freq(32, rope) * factors,
                          scaled_inv_freq(32, {"rope_type": "default", "rope_theta": 500000.0}))
    with pytest.raises(ValueError, match="rope_freqs.weight does not match the config's RoPE "
                                         "scaling \\(rope_type 'default'\\): factor"):
        check_rope_freq_factors(factors, 32, rope_parameters_from_hf({"rope_theta": 500000.0}))
    with pytest.raises(ValueError, match="rope_freqs has 8 factors, expected 16"):
        check_rope_freq_factors(factors[:8], 32, rope)


def test_layers_of_one_config_share_the_cos_sin_tables():
    """Every layer's RotaryEmbedding of one config points at one pair of tables (30 layers of
    copies were 0.6x the weights of a small GGUF model); another config gets its own."""
    params = rope_parameters_from_hf({"rope_theta": 10000.0})
    a, b = RotaryEmbedding(64, 512, params), RotaryEmbedding(64, 512, params)
    assert a.cos_cache.data_ptr() == b.cos_cache.data_ptr()
    assert a.sin_cache.data_ptr() == b.sin_cache.data_ptr()
    other = RotaryEmbedding(64, 512, rope_parameters_from_hf({"rope_theta": 500000.0}))
    assert other.cos_cache.data_ptr() != a.cos_cache.data_ptr()
    assert not torch.equal(other.cos_cache, a.cos_cache)


@pytest.mark.parametrize("interleaved", [True, False])
def test_deepseek_rope_rotates_query_and_key_heads_together_exactly(interleaved):
    """DeepSeek's RoPE rotates q_pe [n, H, dr] and k_pe [n, 1, dr] in one pass: bit for bit
    each tensor rotated alone (and so when they cannot be joined: another row count)."""
    from pagedllm.layers.deepseek_rope import DeepseekRotaryEmbedding

    rope = DeepseekRotaryEmbedding(16, 256, {"rope_type": "default", "rope_theta": 10000.0},
                                   interleaved)
    g = torch.Generator().manual_seed(3)
    positions = torch.tensor([3, 100, 7])
    q, k = torch.randn(3, 8, 16, generator=g), torch.randn(3, 1, 16, generator=g)
    cos = rope.cos_cache[positions][:, None, :]
    sin = rope.sin_cache[positions][:, None, :]
    q_rot, k_rot = rope(positions, q, k)
    assert q_rot.shape == q.shape and k_rot.shape == k.shape
    assert torch.equal(q_rot, rope._rotate(q, cos, sin))
    assert torch.equal(k_rot, rope._rotate(k, cos, sin))
