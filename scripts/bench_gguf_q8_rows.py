"""Thread CPU time of the 8-bit-activation GGUF linears of one forward of a GGUF model, per
number of rows M (the rows a speculative verification step feeds the linears: 1 + drafts),
one thread, with one or more builds of the kernel library alternated in one process
(docs/benchmarks.md, "Verification rows on Q4_1 GGUF").

    OMP_NUM_THREADS=1 python scripts/bench_gguf_q8_rows.py MODEL.gguf [--rows 1-9]
        [--reps 15] [--lib NAME=PATH ...]

Every layer's linears (fused qkv, o, fused gate/up, down) and the tied LM head, in the
row-group layout and the types of the file, as the engine runs them (`linear_gguf_segments_q8`).
Prints per M the median CPU ms over `--reps` interleaved repetitions, the marginal cost of a
row against M = 1 and, with several libraries, the ratio to the first one; also whether every
library gives bitwise-identical outputs.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import time

import numpy as np
import torch

from pagedllm.model_loader.gguf import open_gguf, tensor_data, tensor_table
from pagedllm.native.kernels import abi, cpu_kernels
from pagedllm.native.kernels.quantized_ops import gguf_group_rows, gguf_segment_structs


def _weights(path: str) -> list[tuple[list, int, int]]:
    """The model's linears: (segments, N, K) per linear, segments as gguf_segment_structs takes
    them (grouped)."""
    reader = open_gguf(path)
    buffer = np.memmap(path, dtype=np.uint8, mode="r")
    table = {t.name: t for t in tensor_table(reader)}

    def load(name: str) -> tuple[str, torch.Tensor]:
        info = table[name]
        blocks = torch.from_numpy(np.ascontiguousarray(tensor_data(buffer, info)))
        return info.tensor_type, gguf_group_rows(blocks, info.tensor_type)

    linears = []
    layer = 0
    while f"blk.{layer}.attn_q.weight" in table:
        for names in (("attn_q", "attn_k", "attn_v"), ("attn_output",), ("ffn_gate", "ffn_up"),
                      ("ffn_down",)):
            segments, start = [], 0
            for name in names:
                tensor_type, w = load(f"blk.{layer}.{name}.weight")
                segments.append((start, tensor_type, w, True))
                start += w.shape[0]
            k = table[f"blk.{layer}.{names[0]}.weight"].shape[1]
            linears.append((segments, start, k))
        layer += 1
    head = "output.weight" if "output.weight" in table else "token_embd.weight"
    tensor_type, w = load(head)
    linears.append(([(0, tensor_type, w, True)], w.shape[0], table[head].shape[1]))
    return linears


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--rows", default="1-9", help="M range, e.g. 1-9 or 1,2,5")
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--lib", action="append", default=[],
                        help="NAME=PATH of a built libpagedllm_cpu.so (default: this checkout's)")
    args = parser.parse_args()
    if "-" in args.rows:
        lo, hi = map(int, args.rows.split("-"))
        rows = list(range(lo, hi + 1))
    else:
        rows = [int(r) for r in args.rows.split(",")]
    libs = {}
    for spec in args.lib:
        name, path = spec.split("=", 1)
        lib = ctypes.CDLL(path)
        abi.declare(lib)
        libs[name] = lib
    if not libs:
        libs["this"] = cpu_kernels()
    linears = [(gguf_segment_structs(seg, k), len(seg), n, k, seg)
               for seg, n, k in _weights(args.model)]
    g = torch.Generator().manual_seed(0)
    xs = {m: [torch.randn(m, k, generator=g) for _, _, _, k, _ in linears] for m in rows}
    ys = {m: [torch.empty(m, n) for _, _, n, _, _ in linears] for m in rows}

    def forward(lib, m: int) -> float:
        start = time.thread_time()
        for (structs, count, n, k, _), x, y in zip(linears, xs[m], ys[m]):
            rc = lib.linear_gguf_segments_q8(x.data_ptr(), k, m, k, structs, count, None,
                                             y.data_ptr(), n)
            assert rc == 0
        return time.thread_time() - start

    outputs = {}
    for name, lib in libs.items():   # warm-up, and the outputs to compare
        for m in rows:
            forward(lib, m)
            outputs[name, m] = [y.clone() for y in ys[m]]
    first = next(iter(libs))
    same = all(torch.equal(a, b) for name in libs for m in rows
               for a, b in zip(outputs[name, m], outputs[first, m]))
    times = {(name, m): [] for name in libs for m in rows}
    for _ in range(args.reps):
        for m in rows:
            for name, lib in libs.items():
                times[name, m].append(forward(lib, m))
    print(f"threads {torch.get_num_threads()} OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}"
          f", {len(linears)} linears, median of {args.reps} (thread CPU ms)")
    print("M  " + "  ".join(f"{name:>10} {'+row':>6}" for name in libs) +
          ("  ratio" if len(libs) > 1 else ""))
    for m in rows:
        med = {name: 1e3 * statistics.median(times[name, m]) for name in libs}
        one = {name: 1e3 * statistics.median(times[name, rows[0]]) for name in libs}
        cells = "  ".join(
            f"{med[name]:10.2f} {(med[name] - one[name]) / max(m - rows[0], 1):6.2f}"
            for name in libs)
        ratio = "  " + " ".join(f"{med[first] / med[name]:.2f}" for name in list(libs)[1:]) \
            if len(libs) > 1 else ""
        print(f"{m:<2} {cells}{ratio}")
    print(f"outputs bitwise equal across libraries: {same}; load average "
          f"{os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
