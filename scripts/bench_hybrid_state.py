"""Speed of the hybrid models' state layers (issue #37): the torch reference ops against the native
CPU kernels, and decode cost per token against context length, on the `qwen3-next-200m` preset.

    ops     each state op alone at the preset's shapes (Gated DeltaNet: 4 key / 8 value heads of
            64, conv over 1024 channels, width 4; Mamba-2's SSD at mamba2-130m's shapes: 24 heads
            of 64, state 128, one group), decode (32 requests x 1 token) and prefill (8 x 128
            fresh tokens), torch reference vs native, in one process, best of --repeats.
    engine  `LLM.generate` of N x (input -> output) greedy requests with the state ops on the
            torch reference, then on the native kernels (same process, same weights, same
            tokens checked), best of --repeats each, alternated.
    curve   one request per context length L: prefill L tokens, then time --decode-steps decode
            steps; per step the Gated DeltaNet layers', the attention layers' and the whole
            step's time (timers around the layers' forwards). The preset is copied with
            max_position_embeddings raised to fit the longest L.

Prints a table per mode and, with --output-json, saves the figures; `--plot PNG` draws the
curve (matplotlib). Wall times on a shared machine are inflated: compare the ratios of one run.

    PYTHONPATH=. python scripts/bench_hybrid_state.py ops engine curve --lengths 128,1024,4096
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from pagedllm.layers import state_kernels


def _best(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def _meta(query_lens: list[int], computed: list[int]):
    from pagedllm.attention.metadata import CommonAttentionMetadata
    from pagedllm.layers.state_cache import StateCacheMetadata

    q, c = np.array(query_lens), np.array(computed)
    qsl = np.concatenate([[0], np.cumsum(q)]).astype(np.int32)
    seq = (q + c).astype(np.int32)
    common = CommonAttentionMetadata(
        query_start_loc=torch.from_numpy(qsl), query_start_loc_cpu=qsl,
        seq_lens=torch.from_numpy(seq), seq_lens_cpu=seq,
        block_table=torch.arange(1, len(q) + 1, dtype=torch.int32)[:, None],
        slot_mapping=torch.zeros(int(qsl[-1]), dtype=torch.int64), num_reqs=len(q),
        num_actual_tokens=int(qsl[-1]), max_query_len=int(q.max()), max_seq_len=int(seq.max()),
        block_size=16)
    return StateCacheMetadata.from_common(common)


def bench_ops(repeats: int, dtype: torch.dtype) -> list[dict]:
    """Each op, torch reference vs native, decode and prefill batches."""
    rows = []
    shapes = dict(hk=4, h=8, dk=64, dv=64, conv=2 * 4 * 64 + 8 * 64, width=4,
                  sh=24, sp=64, sn=128, sg=1)
    for phase, query_lens, computed in (("decode 32x1", [1] * 32, [100] * 32),
                                        ("prefill 8x128", [128] * 8, [0] * 8)):
        meta = _meta(query_lens, computed)
        n, r = sum(query_lens), len(query_lens)
        g = torch.Generator().manual_seed(0)

        def rn(*s, act=True):
            return torch.randn(*s, generator=g).to(dtype if act else torch.float32)

        x = rn(n, shapes["conv"])
        w = rn(shapes["conv"], shapes["width"], act=False)
        conv_state = rn(r + 1, shapes["conv"], shapes["width"] - 1)
        q, k = rn(n, shapes["hk"], shapes["dk"]), rn(n, shapes["hk"], shapes["dk"])
        v = rn(n, shapes["h"], shapes["dv"])
        gg = -torch.rand(n, shapes["h"], generator=g)
        beta = torch.rand(n, shapes["h"], generator=g)
        delta_state = rn(r + 1, shapes["h"], shapes["dk"], shapes["dv"], act=False)
        xs = rn(n, shapes["sh"], shapes["sp"])
        dt = torch.rand(n, shapes["sh"], generator=g) * 0.1
        a, d = -torch.rand(shapes["sh"], generator=g), rn(shapes["sh"], act=False)
        b, c = rn(n, shapes["sg"], shapes["sn"]), rn(n, shapes["sg"], shapes["sn"])
        ssm_state = rn(r + 1, shapes["sh"], shapes["sp"], shapes["sn"], act=False)
        ops = {
            "causal conv1d + SiLU (1024 ch)": lambda be: state_kernels.causal_conv1d_varlen(
                x, w, None, conv_state, meta, "silu", backend=be),
            "gated delta rule (8 x 64 x 64)": lambda be: state_kernels.gated_delta_rule_varlen(
                q, k, v, gg, beta, delta_state, meta, backend=be),
            "Mamba-2 SSD (24 x 64 x 128)": lambda be: state_kernels.ssd_varlen(
                xs, dt, a, b, c, d, ssm_state, meta, 256, backend=be),
        }
        for name, fn in ops.items():
            ref = _best(lambda: fn("torch"), repeats)
            nat = _best(lambda: fn("native"), repeats)
            rows.append(dict(op=name, phase=phase, torch_ms=ref * 1e3, native_ms=nat * 1e3,
                             speedup=ref / nat))
    print(f"\n{'op':34s} {'batch':14s} {'torch ms':>9s} {'native ms':>10s} {'x':>6s}")
    for row in rows:
        print(f"{row['op']:34s} {row['phase']:14s} {row['torch_ms']:9.3f} "
              f"{row['native_ms']:10.3f} {row['speedup']:6.1f}")
    return rows


_TEMP_DIRS: list[Path] = []


def _preset(max_len: int, dtype: str) -> str:
    """The qwen3-next-200m preset, copied with max_position_embeddings >= max_len."""
    from pagedllm.benchmarks.presets import preset_path

    src = Path(preset_path("qwen3-next-200m", dtype))
    config = json.loads((src / "config.json").read_text())
    if config.get("max_position_embeddings", 0) >= max_len:
        return str(src)
    dst = Path(tempfile.mkdtemp(prefix="qwen3-next-200m-long-"))
    _TEMP_DIRS.append(dst)
    for f in src.iterdir():
        if f.name != "config.json":
            (dst / f.name).symlink_to(f)
    config["max_position_embeddings"] = max_len
    (dst / "config.json").write_text(json.dumps(config))
    return str(dst)


def bench_engine(args) -> dict:
    from pagedllm import LLM, SamplingParams

    model = _preset(4096, args.dtype)
    llm = LLM(model=model, dtype=args.dtype, max_num_seqs=max(args.num_prompts, 1),
              enable_prefix_caching=False)
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(10, 30000, args.input_len).tolist()}
               for _ in range(args.num_prompts)]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    times: dict[str, list[float]] = {"torch": [], "native": []}
    tokens = {}
    for _ in range(args.repeats):
        for backend in ("torch", "native"):
            state_kernels.DEFAULT_BACKEND = backend
            start = time.perf_counter()
            out = llm.generate(prompts, params, use_tqdm=False)
            times[backend].append(time.perf_counter() - start)
            tokens[backend] = [list(o.outputs[0].token_ids) for o in out]
    state_kernels.DEFAULT_BACKEND = None
    n_out = args.num_prompts * args.output_len
    res = {b: dict(best_s=min(t), output_tok_per_s=n_out / min(t)) for b, t in times.items()}
    res["speedup"] = res["torch"]["best_s"] / res["native"]["best_s"]
    res["identical_requests"] = sum(a == b for a, b in zip(tokens["torch"], tokens["native"]))
    print(f"\nengine {args.num_prompts} x ({args.input_len} -> {args.output_len}) {args.dtype}: "
          f"torch ops {res['torch']['output_tok_per_s']:.1f} tok/s, native "
          f"{res['native']['output_tok_per_s']:.1f} tok/s, x{res['speedup']:.2f}; greedy "
          f"identical {res['identical_requests']}/{args.num_prompts}")
    return res


class _LayerTimers:
    """Accumulates the wall time of the Gated DeltaNet and attention layers' forwards."""

    def __init__(self) -> None:
        from pagedllm.models import qwen3_next

        self.classes = {"gdn": qwen3_next.GatedDeltaNet, "attn": qwen3_next.GatedAttention}
        self.saved = {k: c.forward for k, c in self.classes.items()}
        self.total = {k: 0.0 for k in self.classes}
        self.calls = {k: 0 for k in self.classes}
        for key, cls in self.classes.items():
            cls.forward = self._wrap(key, self.saved[key])

    def _wrap(self, key, forward):
        def timed(module, *a, **kw):
            start = time.perf_counter()
            out = forward(module, *a, **kw)
            self.total[key] += time.perf_counter() - start
            self.calls[key] += 1
            return out
        return timed

    def reset(self) -> tuple[dict[str, float], dict[str, int]]:
        """(seconds, forward calls) per layer kind since the last reset."""
        out = (self.total, self.calls)
        self.total = {k: 0.0 for k in self.classes}
        self.calls = {k: 0 for k in self.classes}
        return out

    def restore(self) -> None:
        for key, cls in self.classes.items():
            cls.forward = self.saved[key]


def bench_curve(args) -> list[dict]:
    from pagedllm import LLM, SamplingParams
    from pagedllm.benchmarks.presets import PRESETS

    lengths = [int(v) for v in args.lengths.split(",")]
    max_len = max(lengths) + args.decode_steps + 16
    model = _preset(max_len, args.dtype)
    llm = LLM(model=model, dtype=args.dtype, max_model_len=max_len, max_num_seqs=2,
              max_num_batched_tokens=args.prefill_chunk, enable_prefix_caching=False)
    engine = llm.llm_engine
    n_gdn = PRESETS["qwen3-next-200m"]["layer_types"].count("linear_attention")
    timers = _LayerTimers()
    rows = []
    rng = np.random.default_rng(1)
    try:
        for length in [lengths[0]] + lengths:      # the first length twice: warm-up
            params = SamplingParams(temperature=0.0, max_tokens=args.decode_steps + 1,
                                    ignore_eos=True)
            rid = f"ctx{length}-{len(rows)}"
            engine.add_request(rid, {"prompt_token_ids":
                                     rng.integers(10, 30000, length).tolist()}, params)
            start = time.perf_counter()
            produced = 0
            while produced == 0:
                for out in engine.step():
                    produced = len(out.outputs[0].token_ids)
            prefill_s = time.perf_counter() - start
            timers.reset()
            start = time.perf_counter()
            while engine.has_unfinished_requests():
                engine.step()
            decode_s = time.perf_counter() - start
            layer_s, calls = timers.reset()
            # one Gated DeltaNet forward per layer and decode forward (a step may run several)
            tokens = max(1, calls["gdn"] // n_gdn)
            row = dict(context=length, prefill_s=prefill_s, decode_tokens=tokens,
                       ms_per_token=decode_s / tokens * 1e3,
                       gdn_ms_per_token=layer_s["gdn"] / tokens * 1e3,
                       attn_ms_per_token=layer_s["attn"] / tokens * 1e3)
            rows.append(row)
    finally:
        timers.restore()
    rows = rows[1:]
    print(f"\n{'context':>8s} {'prefill s':>9s} {'tokens':>6s} {'ms/token':>9s} "
          f"{'9 GDN ms':>9s} {'3 attn ms':>9s}")
    for r in rows:
        print(f"{r['context']:8d} {r['prefill_s']:9.1f} {r['decode_tokens']:6d} "
              f"{r['ms_per_token']:9.2f} {r['gdn_ms_per_token']:9.3f} "
              f"{r['attn_ms_per_token']:9.3f}")
    return rows


def plot_curve(rows: list[dict], path: str) -> None:
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: no plot (the table above has the figures)")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ctx = [r["context"] for r in rows]
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    ax.plot(ctx, [r["ms_per_token"] for r in rows], "o-", label="whole decode step")
    ax.plot(ctx, [r["attn_ms_per_token"] for r in rows], "s-", label="3 attention layers")
    ax.plot(ctx, [r["gdn_ms_per_token"] for r in rows], "^-", label="9 Gated DeltaNet layers")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("ms per decode token (batch 1)")
    ax.set_title("qwen3-next-200m: decode cost per token vs context")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("modes", nargs="+", choices=["ops", "engine", "curve"])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--lengths", default="128,512,2048,8192,16384")
    p.add_argument("--decode-steps", type=int, default=16)
    p.add_argument("--prefill-chunk", type=int, default=2048)
    p.add_argument("--output-json", default=None)
    p.add_argument("--plot", default=None, help="PNG of the curve (matplotlib)")
    args = p.parse_args()
    results: dict = {"dtype": args.dtype, "threads": torch.get_num_threads()}
    dtype = getattr(torch, args.dtype)
    if "ops" in args.modes:
        results["ops"] = bench_ops(args.repeats, dtype)
    if "engine" in args.modes:
        results["engine"] = bench_engine(args)
    if "curve" in args.modes:
        results["curve"] = bench_curve(args)
        if args.plot:
            plot_curve(results["curve"], args.plot)
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(results, indent=1))
    for d in _TEMP_DIRS:
        shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()
