"""The absorbed rows of a mixed step (16 decodes of ~130 positions beside 2032 prefill tokens,
as the batch-32 run's second prefill step has them) at the 200M preset's shape: thread CPU of
`mla_cpu._absorbed_in_kernel` alone, median of 20. Run with PYTHONPATH at each tree."""
import time
import numpy as np
import torch
from pagedllm.attention.backends import mla_cpu
from pagedllm.attention.metadata import CommonAttentionMetadata
from pagedllm.kv_cache_layout import allocate_kv_cache

H, L, DR, DN, DV, BS = 8, 128, 16, 32, 32, 16
q_lens = np.array([1] * 16 + [128] * 15 + [112])
ctx = np.array([129] * 16 + [0] * 16)
seq = ctx + q_lens
nb = -(-seq // BS)
table = np.zeros((32, int(nb.max())), dtype=np.int32)
used = 1
for r, b in enumerate(nb):
    table[r, :b] = np.arange(used, used + b)
    used += b
cache = allocate_kv_cache(used, BS, 1, L + DR, torch.float32, torch.device("cpu"), num_kv=1)
cache.normal_()
qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
n = int(qsl[-1])
common = CommonAttentionMetadata(
    query_start_loc=torch.from_numpy(qsl), query_start_loc_cpu=qsl,
    seq_lens=torch.from_numpy(seq.astype(np.int32)), seq_lens_cpu=seq.astype(np.int32),
    block_table=torch.from_numpy(table), slot_mapping=torch.zeros(n, dtype=torch.int64),
    num_reqs=32, num_actual_tokens=n, max_query_len=128, max_seq_len=int(seq.max()),
    block_size=BS, causal=True)
md = mla_cpu.MLACpuBackend.build_metadata(common)
split = md.split((DN, DR, DV, L))
assert split.kernel_rows.tolist() == list(range(16)), split.kernel_rows
q_nope, q_pe = torch.randn(n, H, DN), torch.randn(n, H, DR)
w = 0.1 * torch.randn(H, DN + DV, L)
ts = []
for _ in range(20):
    t = time.thread_time()
    mla_cpu._absorbed_in_kernel(q_nope, q_pe, cache, md, split, w, 0.1)
    ts.append(time.thread_time() - t)
print(f"{mla_cpu.__file__}: absorbed rows of a {n}-token mixed step: median "
      f"{np.median(ts) * 1e3:.2f} ms, best {min(ts) * 1e3:.2f} ms")
