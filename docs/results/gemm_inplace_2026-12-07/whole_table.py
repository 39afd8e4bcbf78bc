import re, sys, statistics as st, collections
runs = collections.defaultdict(dict)
for f in sys.argv[1:]:
    for line in open(f):
        m = re.match(r"whole round (\d+) (\w+) (\S+) 128 wall \S+ cpu (\S+) (\w+) load (\S+)", line)
        if m:
            r, b, p, cpu, dt, load = m.groups()
            runs[(p, dt)].setdefault(int(r), {})[b] = float(cpu)
for (p, dt), rounds in runs.items():
    base = [rounds[r]["base"] for r in sorted(rounds) if "new" in rounds[r] and "base" in rounds[r]]
    new = [rounds[r]["new"] for r in sorted(rounds) if "new" in rounds[r] and "base" in rounds[r]]
    ratios = [n / b for n, b in zip(new, base)]
    print(f"| {p} | {dt} | {', '.join(f'{x:.2f}' for x in base)} | {', '.join(f'{x:.2f}' for x in new)} | "
          f"{st.mean(new)/st.mean(base):.2f}x (median pair {st.median(ratios):.2f}, {sum(r < 1 for r in ratios)} of {len(ratios)} faster) |")
