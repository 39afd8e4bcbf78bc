"""RequestStream's coalescing of outputs a slow consumer has not read yet: cumulative outputs
keep the latest, DELTA outputs are concatenated (`RequestOutput.add_delta`), so a DELTA consumer
never loses a token whatever the engine's pace."""

from __future__ import annotations

import asyncio

from pagedllm.engine.async_llm import RequestStream
from pagedllm.outputs import CompletionOutput, Logprob, RequestOutput


def out(index_tokens: dict[int, list[int]], finished: bool = False,
        prompt_logprobs=None) -> RequestOutput:
    return RequestOutput("r", None, [1, 2], [
        CompletionOutput(i, "".join(f"<{t}>" for t in toks), toks,
                         logprobs=[{t: Logprob(-float(t))} for t in toks],
                         cumulative_logprob=-float(sum(toks)),
                         finish_reason="length" if finished else None)
        for i, toks in index_tokens.items()], finished, prompt_logprobs=prompt_logprobs)


def drain(items: list[RequestOutput], delta: bool) -> list[RequestOutput]:
    async def run():
        queue: asyncio.Queue = asyncio.Queue()
        for item in items:
            queue.put_nowait(item)        # all queued before the consumer reads: coalesced
        return [o async for o in RequestStream("r", queue, lambda *_: None, delta)]
    return asyncio.run(run())


def test_queued_delta_outputs_are_concatenated_not_dropped():
    got = drain([out({0: [5]}, prompt_logprobs=[None, {2: Logprob(-1.0)}]), out({0: [6, 7]}),
                 out({0: [8]}, finished=True)], delta=True)
    assert len(got) == 1 and got[0].finished
    (c,) = got[0].outputs
    assert c.token_ids == [5, 6, 7, 8] and c.text == "<5><6><7><8>"
    assert [next(iter(d)) for d in c.logprobs] == [5, 6, 7, 8]
    assert c.cumulative_logprob == -8.0 and c.finish_reason == "length"
    assert got[0].prompt_logprobs == [None, {2: Logprob(-1.0)}]


def test_delta_outputs_of_several_sequences_merge_by_index():
    # n = 2 in DELTA mode: each output carries the sequences that advanced.
    got = drain([out({0: [5]}), out({1: [9]}), out({0: [6], 1: [10]}, finished=True)],
                delta=True)
    assert [(c.index, c.token_ids) for c in got[0].outputs] == [(0, [5, 6]), (1, [9, 10])]


def test_cumulative_outputs_keep_only_the_latest():
    got = drain([out({0: [5]}), out({0: [5, 6]}), out({0: [5, 6, 7]}, finished=True)],
                delta=False)
    assert [o.outputs[0].token_ids for o in got] == [[5, 6, 7]]
