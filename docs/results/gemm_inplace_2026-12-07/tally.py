"""Summarise a gemm_tally dump (stderr of a run whose kernels were built with
-DPAGEDLLM_GEMM_TALLY, e.g. `CXX=cxx-tally.sh`): one line per (shape, previous call's shape),
calls with M rows only (default 32: the decode steps of a 32-request batch).
usage: python tally.py STDERR_FILE [M]"""
import sys

rows = [line.split()[1:] for line in open(sys.argv[1]) if line.startswith("gemm_tally")]
m0 = int(sys.argv[2]) if len(sys.argv) > 2 else 32
print("   M     N     K  wb  prev NxK   calls  ms/call  best_ms  first%  GMAC/s  gap_us  total_ms")
total = macs = best = steps = 0
for r in rows:
    m, n, k, wb, pn, pk, c, tn, fn, gn, mn = map(int, r)
    if m != m0:
        continue
    mac = m * n * k * c
    if wb < 100:   # first calls (wb + 100: the repeat of a TWICE build)
        total += tn
        macs += mac
        best += mn * c
        if n == 32000:
            steps = c
    print(f"{m:4d} {n:5d} {k:5d} {wb:3d} {pn:5d}x{pk:<4d} {c:6d} {tn / c / 1e6:8.3f} "
          f"{mn / 1e6:8.3f} {100 * fn / tn:6.1f} {mac / tn:7.1f} {gn / c / 1e3:7.1f} {tn / 1e6:9.1f}")
print(f"first calls, M={m0}: {total / 1e6:.1f} ms, {macs / 1e9:.1f} GMAC, {macs / total:.1f} GMAC/s; "
      f"per step ({steps} steps) {total / 1e6 / max(steps, 1):.2f} ms, at each key's best call "
      f"{best / 1e6 / max(steps, 1):.2f} ms")
