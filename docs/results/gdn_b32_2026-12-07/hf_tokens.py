"""HF transformers' greedy tokens (float32, cached generate) for chosen requests of tokens.py's
batch, compared with the engine's token files: python hf_tokens.py A.json B.json [IDX ...]
(default: the requests where A and B differ)."""
import json, random, sys
import torch
from transformers import AutoModelForCausalLM
from pagedllm.benchmarks.presets import preset_path
torch.set_num_threads(1)
files = [a for a in sys.argv[1:] if a.endswith(".json")]
toks = [json.load(open(p)) for p in files]
idx = [int(a) for a in sys.argv[1:] if not a.endswith(".json")] or [
    i for i, (x, y) in enumerate(zip(toks[0], toks[1])) if x != y]
rng = random.Random(0)
prompts = [[rng.randrange(100, 30000) for _ in range(128)] for _ in range(32)]
model = AutoModelForCausalLM.from_pretrained(preset_path("qwen3-next-200m", "float32"),
                                             torch_dtype=torch.float32).eval()
for i in idx:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompts[i]]), max_new_tokens=128, do_sample=False)
    hf = out[0, 128:].tolist()
    for p, t in zip(files, toks):
        first = next((j for j, (u, v) in enumerate(zip(hf, t[i])) if u != v), None)
        said = 'identical' if first is None else f'first differs at {first}'
        print(f"request {i}: {p} vs HF: {said}")
