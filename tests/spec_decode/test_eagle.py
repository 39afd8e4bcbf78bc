"""EAGLE / EAGLE-3 heads with random weights in the published layouts (the EAGLE authors' and
vLLM's speculators): they load, draft, and leave greedy outputs unchanged (batched, chunked
prefill, preemption, prefix caching), and the first draft equals a plain-torch reference of the
head run over the target's hidden states."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from pagedllm import LLM, SamplingParams

PROMPTS = [[5, 6, 7, 8] * 6 + [5, 6], list(range(20, 61)), [100, 3, 250, 7] * 5, [42]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
H, I, V, DRAFT_V = 64, 128, 512, 128
LAYER = {"hidden_size": H, "intermediate_size": I, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-6, "vocab_size": V,
         "max_position_embeddings": 1024, "hidden_act": "silu"}


def _layer_tensors(prefix: str, qkv_in: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    def r(*shape):
        return torch.randn(*shape, generator=g) * 0.2
    return {f"{prefix}self_attn.q_proj.weight": r(64, qkv_in),
            f"{prefix}self_attn.k_proj.weight": r(32, qkv_in),
            f"{prefix}self_attn.v_proj.weight": r(32, qkv_in),
            f"{prefix}self_attn.o_proj.weight": r(H, 64),
            f"{prefix}post_attention_layernorm.weight": 1 + r(H),
            f"{prefix}mlp.gate_proj.weight": r(I, H), f"{prefix}mlp.up_proj.weight": r(I, H),
            f"{prefix}mlp.down_proj.weight": r(H, I)}


def write_head(folder: Path, method: str, layout: str, seed: int = 0) -> Path:
    """A random head in `layout` ("authors" or "speculators")."""
    g = torch.Generator().manual_seed(seed)
    folder.mkdir(parents=True, exist_ok=True)
    prefix = "midlayer." if method == "eagle3" and layout == "authors" else "layers.0."
    if method == "eagle3":
        tensors = _layer_tensors(prefix, 2 * H, g)
        draft_ids = torch.randperm(V, generator=g)[:DRAFT_V].sort().values
        t2d = torch.zeros(V, dtype=torch.bool)
        t2d[draft_ids] = True
        tensors.update({"fc.weight": torch.randn(H, 3 * H, generator=g) * 0.1,
                        f"{prefix}input_layernorm.weight": torch.ones(H),
                        f"{prefix}hidden_norm.weight": torch.ones(H),
                        "norm.weight": torch.ones(H),
                        "lm_head.weight": torch.randn(DRAFT_V, H, generator=g),
                        "d2t": draft_ids - torch.arange(DRAFT_V), "t2d": t2d})
        extra = {"draft_vocab_size": DRAFT_V, "eagle_aux_hidden_state_layer_ids": [0, 1, 1]}
    else:
        tensors = _layer_tensors(prefix, H, g)
        tensors["fc.weight"] = torch.randn(H, 2 * H, generator=g) * 0.1
        extra = {}
    if layout == "authors":
        config = {"architectures": ["LlamaForCausalLMEagle3" if method == "eagle3"
                                    else "LlamaForCausalLM"], **LAYER, **extra}
    else:
        config = {"speculators_model_type": method, "architectures": [
            "Eagle3Speculator" if method == "eagle3" else "EagleSpeculator"],
            "transformer_layer_config": {"model_type": "llama", **LAYER}, **extra}
        tensors = {f"model.{k}" if k.startswith("layers.") else k: v for k, v in tensors.items()}
    (folder / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
    return folder


@pytest.fixture(scope="module")
def target(tiny_checkpoints):
    return str(tiny_checkpoints["llama"])


@pytest.fixture(scope="module")
def reference(target):
    llm = LLM(target, dtype="float32", kv_cache_memory_bytes=8 << 20)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.fixture(scope="module")
def heads(tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle_heads")
    return {(m, layout): write_head(root / f"{m}-{layout}", m, layout)
            for m in ("eagle", "eagle3") for layout in ("authors", "speculators")}


@pytest.mark.parametrize("method,layout", [("eagle3", "authors"), ("eagle3", "speculators"),
                                           ("eagle", "authors"), ("eagle", "speculators")])
def test_greedy_unchanged_batched_chunked(target, reference, heads, method, layout):
    llm = LLM(target, dtype="float32", kv_cache_memory_bytes=8 << 20, max_num_batched_tokens=16,
              speculative_config={"method": method, "model": str(heads[method, layout]),
                                  "num_speculative_tokens": 3})
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert llm.get_stats().spec_decoding_stats.num_draft_tokens > 0


def test_preemption_and_prefix_caching(target, reference, heads):
    llm = LLM(target, dtype="float32", num_gpu_blocks_override=12, max_num_batched_tokens=32,
              speculative_config={"method": "eagle3", "model": str(heads["eagle3", "authors"]),
                                  "num_speculative_tokens": 3})
    for _ in range(2):   # the second time with prefix-cache hits
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == reference
    assert llm.get_stats().num_preemptions > 0


def test_wrong_method_for_layout_is_an_error(target, heads):
    with pytest.raises(ValueError, match="eagle"):
        LLM(target, dtype="float32", kv_cache_memory_bytes=8 << 20,
            speculative_config={"method": "eagle", "model": str(heads["eagle3", "speculators"]),
                                "num_speculative_tokens": 2})


def test_a_full_model_as_eagle_head_is_an_error_naming_draft_model(target):
    with pytest.raises(ValueError, match="not an EAGLE head.*'draft_model'"):
        LLM(target, dtype="float32", kv_cache_memory_bytes=8 << 20,
            speculative_config={"method": "eagle", "model": target,
                                "num_speculative_tokens": 2})


def _rms(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x, positions, head_size):
    inv = 1.0 / (10000.0 ** (torch.arange(0, head_size, 2, dtype=torch.float64) / head_size))
    ang = positions[:, None].double() * inv[None]
    cos, sin = torch.cat([ang.cos()] * 2, -1).float(), torch.cat([ang.sin()] * 2, -1).float()
    x1, x2 = x[..., :head_size // 2], x[..., head_size // 2:]
    return x * cos[:, None] + torch.cat([-x2, x1], -1) * sin[:, None]


def _reference_head(t: dict, method: str, prefix: str, tokens, hidden, embed):
    """Plain-torch EAGLE (-3) over a whole sequence (causal, no cache): -> (draft ids of each
    row in the target vocabulary, pre-norm hidden of each row)."""
    n = len(tokens)
    x = embed[torch.tensor(tokens)]
    if method == "eagle3":
        h = hidden @ t["fc.weight"].T if hidden.shape[-1] != H else hidden
        residual = h
        a = torch.cat([_rms(x, t[f"{prefix}input_layernorm.weight"]),
                       _rms(h, t[f"{prefix}hidden_norm.weight"])], -1)
    else:
        h = torch.cat([x, hidden], -1) @ t["fc.weight"].T
        residual, a = h, h
    pos = torch.arange(n)
    q = (a @ t[f"{prefix}self_attn.q_proj.weight"].T).view(n, 4, 16)
    k = (a @ t[f"{prefix}self_attn.k_proj.weight"].T).view(n, 2, 16)
    v = (a @ t[f"{prefix}self_attn.v_proj.weight"].T).view(n, 2, 16)
    q, k = _rope(q, pos, 16), _rope(k, pos, 16)
    k, v = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    att = torch.einsum("qhd,khd->hqk", q, k) / 4.0
    att = att.masked_fill(torch.triu(torch.ones(n, n, dtype=torch.bool), 1), float("-inf"))
    o = torch.einsum("hqk,khd->qhd", att.softmax(-1), v).reshape(n, 64)
    h = o @ t[f"{prefix}self_attn.o_proj.weight"].T + residual
    residual = h
    m = _rms(h, t[f"{prefix}post_attention_layernorm.weight"])
    m = (torch.nn.functional.silu(m @ t[f"{prefix}mlp.gate_proj.weight"].T)
         * (m @ t[f"{prefix}mlp.up_proj.weight"].T)) @ t[f"{prefix}mlp.down_proj.weight"].T
    prenorm = m + residual
    return prenorm


@pytest.mark.parametrize("method", ["eagle3", "eagle"])
def test_drafts_equal_a_plain_torch_head(target, heads, method):
    """The engine's k drafts after the prefill step equal the head run without a KV cache
    over HF's hidden states of the target (the oracle of the hidden-state plumbing, the
    token shift and the head's KV)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    k = 3
    folder = heads[method, "authors"]
    t = load_file(str(folder / "model.safetensors"))
    prefix = "midlayer." if method == "eagle3" else "layers.0."
    hf = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    prompt = PROMPTS[1]
    llm = LLM(target, dtype="float32", kv_cache_memory_bytes=8 << 20,
              speculative_config={"method": method, "model": str(folder),
                                  "num_speculative_tokens": k})
    engine = llm.llm_engine
    engine.add_request("r", {"prompt_token_ids": prompt},
                       SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    engine.step()
    request = engine.engine_core.scheduler.requests["r"]
    drafts = list(request.spec_token_ids)
    first = request.output_token_ids[0]
    with torch.no_grad():
        out = hf(torch.tensor([prompt]), output_hidden_states=True)
        assert int(out.logits[0, -1].argmax()) == first
        states = out.hidden_states
        hidden = (torch.cat([states[0], states[1], states[1]], -1) if method == "eagle3"
                  else states[-1])[0]
        if method == "eagle3":   # fc applies to the target's states (the first step's rows)
            hidden = hidden @ t["fc.weight"].T
        embed = hf.model.embed_tokens.weight
        tokens = prompt[1:] + [first]
        want = []
        for _ in range(k):
            prenorm = _reference_head(t, method, prefix, tokens, hidden, embed)
            last = prenorm[-1]
            if method == "eagle3":
                ids = int((_rms(last, t["norm.weight"]) @ t["lm_head.weight"].T).argmax())
                token = ids + int(t["d2t"][ids])
            else:
                token = int(hf.lm_head(last).argmax())
            want.append(token)
            tokens = tokens + [token]
            hidden = torch.cat([hidden, last[None]], 0)
    assert drafts == want


def test_n_samples_and_structured_output(target, reference, heads):
    import json as json_

    llm = LLM(target, dtype="float32", kv_cache_memory_bytes=8 << 20,
              speculative_config={"method": "eagle3", "model": str(heads["eagle3", "authors"]),
                                  "num_speculative_tokens": 3})
    n2 = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, n=2)
    outs = llm.generate(PROMPTS[:2], n2, use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in outs] == [[r, r] for r in reference[:2]]
    schema = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0,
                                                   "maximum": 9}}, "required": ["a"],
              "additionalProperties": False}
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=80,
                             structured_outputs={"json": schema}) for i in range(3)]
    for o in llm.generate(['{"a": 1} {"a": 1}'] * 3, params, use_tqdm=False):
        assert set(json_.loads(o.outputs[0].text)) == {"a"}
