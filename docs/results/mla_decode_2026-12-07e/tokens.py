"""Greedy tokens of deepseek-v2-lite-200m float32, 32 x (128 -> 64), written to argv[1] (json),
to compare two checkouts (run each with its own PYTHONPATH / PAGEDLLM_KERNEL_CACHE)."""
import json, random, sys
from pagedllm import LLM, SamplingParams
from pagedllm.benchmarks.presets import preset_path
llm = LLM(model=preset_path("deepseek-v2-lite-200m", "float32"), dtype="float32", max_model_len=512, seed=0)
rng = random.Random(1)
prompts = [{"prompt_token_ids": [rng.randrange(100, 30000) for _ in range(128)]} for _ in range(32)]
outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True, logprobs=0), use_tqdm=False)
json.dump([[o.outputs[0].token_ids, [next(iter(d.values())).logprob for d in o.outputs[0].logprobs]] for o in outs], open(sys.argv[1], "w"))
