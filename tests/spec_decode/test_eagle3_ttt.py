"""The EAGLE-3 training-time test (`spec_decode/eagle3_ttt.py`): its unrolled steps compute what
the engine drafts (a random head saved in the authors' layout, on the tiny random Llama target),
a step never reads tokens after the one it is fed, and a few optimizer steps reduce its loss."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from pagedllm import LLM, SamplingParams
from pagedllm.spec_decode.eagle3_ttt import Eagle3TrainHead, ttt_loss

DRAFT_V = 128


def _random_head(cfg: dict, seed: int = 0) -> Eagle3TrainHead:
    torch.manual_seed(seed)
    head = Eagle3TrainHead(cfg["hidden_size"], cfg["intermediate_size"],
                           cfg["num_attention_heads"], cfg["num_key_value_heads"],
                           cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"],
                           cfg["rms_norm_eps"], cfg.get("rope_theta", 10000.0), DRAFT_V)
    with torch.no_grad():
        for p in head.parameters():     # norms away from 1, so swapped names would show
            p.add_(torch.randn_like(p) * (0.3 if p.dim() == 1 else 0.05))
    return head


@pytest.mark.parametrize("fused", [True, False])
def test_unrolled_steps_equal_the_engines_drafts(tiny_llama, tmp_path, monkeypatch, fused):
    """Step j's argmax at the prompt's last row, fed with the engine's own earlier drafts, is
    the engine's draft j + 1 after the prefill (k = 3): the attention pattern, positions and
    hidden-state feedback of the training code are the engine's. Both target paths: the
    native fused decoder stack (split at the auxiliary layers) and the module path."""
    from transformers import AutoModelForCausalLM

    from pagedllm.native.fused_decoder import FusedDecoder

    captured = []
    call = FusedDecoder.__call__

    def spy(self, positions, residual, delta, metadata, capture=None):
        out = call(self, positions, residual, delta, metadata, capture)
        captured.append(capture is not None)
        return out

    monkeypatch.setattr(FusedDecoder, "__call__", spy)
    if not fused:
        monkeypatch.setenv("PAGEDLLM_CPU_FUSED_DECODER", "0")

    cfg = json.loads((tiny_llama / "config.json").read_text())
    vocab, k = cfg["vocab_size"], 3
    head = _random_head(cfg)
    g = torch.Generator().manual_seed(1)
    draft_ids = torch.randperm(vocab, generator=g)[:DRAFT_V].sort().values
    tensors = head.checkpoint()
    tensors["d2t"] = draft_ids - torch.arange(DRAFT_V)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[draft_ids] = True
    tensors["t2d"] = t2d
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLMEagle3"], **{key: cfg[key] for key in (
            "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
            "rms_norm_eps", "vocab_size", "max_position_embeddings")},
        "draft_vocab_size": DRAFT_V, "eagle_aux_hidden_state_layer_ids": [0, 1, 1]}))

    prompt = [3 + (i * 37) % (vocab - 3) for i in range(29)]
    llm = LLM(str(tiny_llama), dtype="float32", kv_cache_memory_bytes=8 << 20,
              speculative_config={"method": "eagle3", "model": str(tmp_path),
                                  "num_speculative_tokens": k})
    engine = llm.llm_engine
    engine.add_request("r", {"prompt_token_ids": prompt},
                       SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    engine.step()
    request = engine.engine_core.scheduler.requests["r"]
    drafts = list(request.spec_token_ids)
    assert len(drafts) == k
    seq = prompt + [request.output_token_ids[0]] + drafts

    hf = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32)
    with torch.no_grad():
        states = hf.model(torch.tensor([seq]), output_hidden_states=True).hidden_states
        n = len(prompt)
        feats = torch.cat([states[0], states[1], states[1]], -1)[:, :n]
        embeds = hf.model.embed_tokens(torch.tensor([seq[1:n + k]]))
        logits = head.ttt_forward(embeds, feats, k)
    got = [int(draft_ids[lg[0, n - 1].argmax()]) for lg in logits]
    assert got == drafts
    assert any(captured) == fused      # the fused stack ran with captures (or not at all)


def test_steps_are_causal_and_the_loss_falls():
    """Step j at row r reads no embedding row after r + j (the token it is fed); AdamW on
    one fixed batch lowers the decayed loss; masked targets are not scored."""
    h, k, n = 32, 3, 12
    torch.manual_seed(0)
    head = Eagle3TrainHead(h, 64, 4, 2, 8, 1e-6, 10000.0, 50)
    embeds, feats = torch.randn(2, n + k - 1, h), torch.randn(2, n, 3 * h)
    base = head.ttt_forward(embeds, feats, k)
    p = 5
    changed = embeds.clone()
    changed[:, p + k:] = torch.randn_like(changed[:, p + k:])
    for j, lg in enumerate(head.ttt_forward(changed, feats, k)):
        # Step j at row r reads embedding rows <= r + j: rows < p + k - j keep their logits,
        # row p + k - j (which reads the first changed row) does not.
        torch.testing.assert_close(lg[:, :p + k - j], base[j][:, :p + k - j])
        assert not torch.allclose(lg[:, p + k - j], base[j][:, p + k - j])

    targets = torch.randint(0, 50, (2, n + k - 1))
    targets[0, :4] = -100
    loss, stats = ttt_loss(base, targets)
    want = sum(0.8 ** j * F.cross_entropy(base[j][targets[:, j:j + n] >= 0],
                                          targets[:, j:j + n][targets[:, j:j + n] >= 0])
               for j in range(k))
    torch.testing.assert_close(loss, want)
    assert [s[1] for s in stats] == [2 * n - 4, 2 * n - 3, 2 * n - 2]

    opt = torch.optim.AdamW(head.parameters(), lr=3e-3)
    first = float(loss.detach())
    threads = torch.get_num_threads()
    torch.set_num_threads(1)    # tiny matrices: threads only wait for each other
    try:
        for _ in range(30):
            loss, _ = ttt_loss(head.ttt_forward(embeds, feats, k), targets)
            opt.zero_grad()
            loss.backward()
            opt.step()
    finally:
        torch.set_num_threads(threads)
    assert float(loss.detach()) < 0.5 * first


def test_too_few_embedding_rows_is_an_error():
    head = Eagle3TrainHead(16, 32, 2, 1, 8, 1e-6, 10000.0, 10)
    with pytest.raises(ValueError, match="need 7 embedding rows"):
        head.ttt_forward(torch.randn(1, 6, 16), torch.randn(1, 5, 48), 3)


def test_engine_features_equal_hf_hidden_states(tiny_llama):
    """`scripts/train_eagle3.py`'s engine features (pagedllm's target over whole sequences,
    several per prefill batch, one longer than the batch budget alone) are HF's inputs of the
    auxiliary layers, row for row (bfloat16 storage)."""
    import importlib.util
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    path = Path(__file__).resolve().parents[2] / "scripts" / "train_eagle3.py"
    spec = importlib.util.spec_from_file_location("train_eagle3", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    seqs = [[3 + (i * 37 + j) % 200 for i in range(n)] for j, n in enumerate((5, 40, 23, 70))]
    aux = (0, 1, 1)
    feats = script.engine_features(str(tiny_llama), seqs, aux, "float32", max_tokens=64)
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32)
    with torch.no_grad():
        for seq, got in zip(seqs, feats):
            states = hf.model(torch.tensor([seq]), output_hidden_states=True).hidden_states
            want = torch.cat([states[i] for i in aux], -1)[0]
            assert got.dtype == torch.bfloat16 and got.shape == want.shape
            torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=1e-2)
