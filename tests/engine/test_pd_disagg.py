"""Prefill/decode disaggregation (P2pShmConnector) without HTTP: a prefill LLM (kv_producer) and a
decode LLM (kv_consumer) in this process, matched through kv_transfer_params as vLLM's toy proxy
does, give the tokens one engine gives (greedy and seeded); the decode instance loads the
prompt's KV (cached tokens) instead of computing it; a dead or silent peer, a foreign peer and
bad parameters fail those requests alone."""

from __future__ import annotations

import random

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.core.kv_connector.p2p_transport import transfer_file, transfer_key
from pagedllm.entrypoints.llm import GenerateError
from tests.entrypoints.openai.server_process import free_port

RNG = random.Random(0)
# Prompt lengths around block boundaries (block_size 16): 17, 31, 32, 33, 40, 5.
PROMPTS = [[RNG.randrange(3, 500) for _ in range(n)] for n in (17, 31, 32, 33, 40, 5)]
ENGINE = dict(dtype="float32", block_size=16, max_num_seqs=4, num_gpu_blocks_override=64)
PARAMS = [SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
          SamplingParams(temperature=1.0, seed=7, max_tokens=6, ignore_eos=True)]


def pd_config(role: str, port: int, shm_dir, **extra) -> dict:
    return {"kv_connector": "P2pShmConnector", "kv_role": role, "kv_port": port,
            "kv_connector_extra_config": {"shm_dir": str(shm_dir), **extra}}


def with_params(params: SamplingParams, max_tokens: int, kv_transfer_params: dict
                ) -> SamplingParams:
    return SamplingParams(temperature=params.temperature, seed=params.seed,
                          max_tokens=max_tokens, ignore_eos=True,
                          extra_args={"kv_transfer_params": kv_transfer_params})


def transfer_files(shm_dir) -> list:
    """The transfer files in `shm_dir` (not the live producer's lock file: shm_owner.py)."""
    return [p for p in shm_dir.iterdir() if not p.name.endswith(".lock")]


def generate(llm: LLM, prompts, params) -> list:
    """The outputs, those of failed requests included (finish_reason "error")."""
    try:
        return llm.generate(prompts, params, use_tqdm=False)
    except GenerateError as e:
        return e.outputs


def disaggregated(prefill: LLM, decode: LLM, prompts, params: SamplingParams):
    """vLLM's toy proxy, offline: max_tokens=1 on the prefill instance, then the request with
    the returned kv_transfer_params on the decode instance."""
    first = prefill.generate(prompts, with_params(params, 1, {"do_remote_decode": True}),
                             use_tqdm=False)
    return [decode.generate([p], with_params(params, params.max_tokens, o.kv_transfer_params),
                            use_tqdm=False)[0] for p, o in zip(prompts, first)]


@pytest.fixture(scope="module")
def pair(tiny_llama, tmp_path_factory):
    shm = tmp_path_factory.mktemp("shm")
    port = free_port()
    prefill = LLM(str(tiny_llama), **ENGINE, kv_transfer_config=pd_config("kv_producer", port,
                                                                          shm))
    # (The decode instance schedules asynchronously, CUDA's default: a waiting request and
    # the in-flight steps.)
    decode = LLM(str(tiny_llama), **ENGINE, enable_prefix_caching=False, async_scheduling=True,
                 kv_transfer_config=pd_config("kv_consumer", port, shm, transfer_timeout=2))
    yield prefill, decode, shm, port
    prefill.llm_engine.engine_core.shutdown()
    decode.llm_engine.engine_core.shutdown()


def test_same_tokens_as_one_engine(tiny_llama, pair):
    prefill, decode, shm, port = pair
    single = LLM(str(tiny_llama), **ENGINE)
    for params in PARAMS:
        want = [list(o.outputs[0].token_ids)
                for o in single.generate(PROMPTS, params, use_tqdm=False)]
        outs = disaggregated(prefill, decode, PROMPTS, params)
        assert [o.outputs[0].error for o in outs] == [None] * len(PROMPTS)
        assert [list(o.outputs[0].token_ids) for o in outs] == want
        # The decode instance loaded every prompt token but the last.
        assert [o.num_cached_tokens for o in outs] == [len(p) - 1 for p in PROMPTS]
    # Every transfer file was pulled and deleted (the live producer's lock file stays).
    assert transfer_files(shm) == []
    first = prefill.generate(PROMPTS[:1], with_params(PARAMS[0], 1, {"do_remote_decode": True}),
                             use_tqdm=False)[0]
    assert first.kv_transfer_params == {
        "do_remote_prefill": True, "do_remote_decode": False,
        "remote_engine_id": f"pagedllm{port}", "remote_host": "127.0.0.1",
        "remote_port": port, "remote_request_id": first.request_id}
    # A pull hands the files over: a second decode of the same params finds nothing.
    ok = decode.generate(PROMPTS[:1], with_params(PARAMS[0], 2, first.kv_transfer_params),
                         use_tqdm=False)[0]
    again = generate(decode, PROMPTS[:1], with_params(PARAMS[0], 2,
                                                      first.kv_transfer_params))[0]
    assert ok.outputs[0].error is None
    assert "holds no KV for this request" in again.outputs[0].error


def test_bad_params_fail_alone(pair):
    prefill, decode, shm, port = pair
    params = PARAMS[0]
    good = prefill.generate(PROMPTS[:2], with_params(params, 1, {"do_remote_decode": True}),
                            use_tqdm=False)
    foreign = {**good[0].kv_transfer_params, "remote_port": port + 1}
    unsafe = {**good[0].kv_transfer_params, "remote_engine_id": "../etc"}
    plain = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    missing = {"do_remote_prefill": True}
    # Checked by the front end (a 400 on the server): rejected before reaching the engine.
    with pytest.raises(GenerateError) as rejected:
        decode.generate([PROMPTS[0]] * 3 + [PROMPTS[1], PROMPTS[2]],
                        [with_params(params, 3, foreign), with_params(params, 3, unsafe),
                         with_params(params, 3, missing),
                         with_params(params, 3, good[1].kv_transfer_params), plain],
                        use_tqdm=False)
    errors, outs = rejected.value.errors, rejected.value.outputs
    assert "accepts only 127.0.0.1" in errors[0]
    assert "remote_engine_id" in errors[1]
    assert "needs remote_host, remote_port, remote_engine_id, remote_request_id" in errors[2]
    assert sorted(errors) == [0, 1, 2]
    assert [o.outputs[0].error for o in outs[3:]] == [None, None]
    assert len(outs[3].outputs[0].token_ids) == 3 and len(outs[4].outputs[0].token_ids) == 3
    # The first request's files were never pulled: the prefill instance still offers them.
    assert prefill.llm_engine.engine_core.scheduler.kv_connector.server.num_offers() == 1


def test_dead_peer_fails_those_requests(tiny_llama, tmp_path):
    """A decode instance whose prefill peer is gone (or never answers) fails the requests that
    need it within transfer_timeout; the others are served."""
    port = free_port()
    prefill = LLM(str(tiny_llama), **ENGINE,
                  kv_transfer_config=pd_config("kv_producer", port, tmp_path))
    decode = LLM(str(tiny_llama), **ENGINE, kv_transfer_config=pd_config(
        "kv_consumer", port, tmp_path, transfer_timeout=0.5))
    outs = prefill.generate(PROMPTS[:2], with_params(PARAMS[0], 1, {"do_remote_decode": True}),
                            use_tqdm=False)
    prefill.llm_engine.engine_core.shutdown()   # the prefill instance dies
    # (its shutdown deleted the offered files; the pull never gets that far)
    assert not transfer_file(tmp_path, f"pagedllm{port}", transfer_key(outs[0].request_id),
                             0).exists()
    plain = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    got = generate(decode, PROMPTS[:3], [with_params(PARAMS[0], 4, outs[0].kv_transfer_params),
                                         plain, with_params(PARAMS[0], 4,
                                                            outs[1].kv_transfer_params)])
    assert "did not answer within 0.5 s" in got[0].outputs[0].error
    assert got[0].outputs[0].finish_reason == "error"
    assert got[1].outputs[0].error is None and len(got[1].outputs[0].token_ids) == 4
    assert "did not answer" in got[2].outputs[0].error
    # The server goes on.
    again = decode.generate(PROMPTS[3:4], plain, use_tqdm=False)[0]
    assert again.outputs[0].error is None and len(again.outputs[0].token_ids) == 4
    decode.llm_engine.engine_core.shutdown()


@pytest.mark.parametrize("config, match", [
    ({"kv_role": "kv_both"}, "kv_role must be kv_producer"),
    ({"kv_role": "prefill"}, "kv_role must be kv_producer"),
    ({"kv_port": 0}, "kv_port must be a port"),
    ({"engine_id": "a/b"}, "engine_id"),
    ({"kv_connector_extra_config": {"timeout": 3}}, r"unknown kv_connector_extra_config keys "
                                                    r"\['timeout'\]"),
    ({"kv_connector_extra_config": {"transfer_timeout": -1}}, "transfer_timeout"),
    ({"kv_connector": "NixlConnector"}, "unknown kv_connector 'NixlConnector'"),
    ({"kv_buffer_size": 3}, r"unknown keys \['kv_buffer_size'\]"),
])
def test_config_errors_name_the_key(config, match):
    from pagedllm.config import KVTransferConfig
    values = {"kv_connector": "P2pShmConnector", "kv_role": "kv_producer", **config}
    with pytest.raises(ValueError, match=match):
        KVTransferConfig.from_dict(values)


@pytest.mark.slow
def test_tp2_pair_and_a_layout_mismatch(tiny_llama, tmp_path):
    """tp=2 on both sides (mp workers): each rank writes and reads its own shard's file, and the
    tokens equal one engine's; a tp=1 decode instance refuses a tp=2 prefill's KV by layout."""
    port = free_port()
    tp2 = dict(tensor_parallel_size=2, distributed_executor_backend="mp")
    single = LLM(str(tiny_llama), **ENGINE)
    want = [list(o.outputs[0].token_ids)
            for o in single.generate(PROMPTS, PARAMS[1], use_tqdm=False)]
    prefill = LLM(str(tiny_llama), **ENGINE, **tp2,
                  kv_transfer_config=pd_config("kv_producer", port, tmp_path))
    decode = LLM(str(tiny_llama), **ENGINE, **tp2,
                 kv_transfer_config=pd_config("kv_consumer", port, tmp_path))
    narrow = LLM(str(tiny_llama), **ENGINE,
                 kv_transfer_config=pd_config("kv_consumer", port, tmp_path))
    try:
        outs = disaggregated(prefill, decode, PROMPTS, PARAMS[1])
        assert [list(o.outputs[0].token_ids) for o in outs] == want
        first = prefill.generate(PROMPTS[:1], with_params(PARAMS[0], 1,
                                                          {"do_remote_decode": True}),
                                 use_tqdm=False)[0]
        refused = generate(narrow, PROMPTS[:1], with_params(PARAMS[0], 2,
                                                            first.kv_transfer_params))[0]
        assert "KV layouts" in refused.outputs[0].error
        assert transfer_files(tmp_path) == []
    finally:
        for llm in (prefill, decode, narrow):
            llm.llm_engine.engine_core.shutdown()
