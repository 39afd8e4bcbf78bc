"""First generated token of 16 random 128-token prompts on the bf16 preset checkpoint:
HF float32 (reference, weights upcast), HF bf16, pagedllm bf16, pagedllm float32."""
import random, sys, torch
from transformers import AutoModelForCausalLM
from pagedllm import LLM, SamplingParams
from pagedllm.benchmarks.presets import preset_path
P = sys.argv[1]
path = preset_path(P, "bfloat16")
rng = random.Random(0)
prompts = [[rng.randrange(100, 30000) for _ in range(128)] for _ in range(16)]
ref = {}
for dt in (torch.float32, torch.bfloat16):
    m = AutoModelForCausalLM.from_pretrained(path, dtype=dt).eval()
    with torch.no_grad():
        logits = torch.stack([m(torch.tensor([p])).logits[0, -1].float() for p in prompts])
    ref[str(dt)] = logits
    del m
f32 = ref["torch.float32"]
top2 = f32.topk(2, dim=-1)
gap = (top2.values[:, 0] - top2.values[:, 1])
lp = torch.log_softmax(f32, -1)
print("fp32 ref top1-top2 logit gap: median %.4f min %.4f" % (gap.median(), gap.min()))
print("HF bf16 top1 == ref:", (ref["torch.bfloat16"].argmax(-1) == f32.argmax(-1)).sum().item(), "/16")
for dt in ("bfloat16", "float32"):
    llm = LLM(model=path, dtype=dt, max_model_len=512, seed=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    toks = torch.tensor([o.outputs[0].token_ids[0] for o in outs])
    agree = (toks == f32.argmax(-1)).sum().item()
    # how far below the reference's best each chosen token is (fp32 ref logprob gap)
    loss = (lp.max(-1).values - lp[torch.arange(16), toks])
    print(f"pagedllm {dt} top1 == ref: {agree}/16, ref logprob deficit of its choice: max {loss.max():.4f}")
    del llm
hb = ref["torch.bfloat16"].argmax(-1)
print("HF bf16 ref logprob deficit: max %.4f" % (lp.max(-1).values - lp[torch.arange(16), hb]).max())
