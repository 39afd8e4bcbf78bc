"""The greedy tokens of run32.py's 32 x (128 -> 128) batch, written to OUT.json (to compare two
checkouts: python tokens.py OUT.json; then python tokens.py --compare A.json B.json).
DT=float32|bfloat16 picks the dtype."""
import json, os, random, sys
if sys.argv[1] == "--compare":
    a, b = (json.load(open(p)) for p in sys.argv[2:4])
    same = sum(x == y for x, y in zip(a, b))
    first = [next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), None) for x, y in zip(a, b)]
    print(f"{same}/{len(a)} requests with identical tokens; first differing position of the "
          f"others: {[f for f in first if f is not None]}")
    sys.exit()
from pagedllm import LLM, SamplingParams
from pagedllm.benchmarks.presets import preset_path
DT = os.environ.get("DT", "float32")
llm = LLM(model=preset_path("qwen3-next-200m", DT), dtype=DT, max_model_len=512, seed=0)
rng = random.Random(0)
prompts = [{"prompt_token_ids": [rng.randrange(100, 30000) for _ in range(128)]} for _ in range(32)]
outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True),
                    use_tqdm=False)
json.dump([list(o.outputs[0].token_ids) for o in outs], open(sys.argv[1], "w"))
