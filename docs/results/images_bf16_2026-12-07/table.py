"""Markdown rows from ab.sh's JSON files: python table.py DIR."""
import glob, json, os, sys
d = sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(__file__)
for path in sorted(glob.glob(os.path.join(d, "*_r*.json")), key=lambda p: (p.split("_r")[-1], p)):
    ours, hf = json.load(open(path))["results"]
    tag = os.path.basename(path)[:-5]
    preset, dtype, tree, rnd = tag.rsplit("_", 3)
    print(f"| {preset} | {dtype} | {rnd[1:]} | {tree} | {ours['elapsed_s']:.2f} s | {ours['encoder_s']:.2f} s "
          f"({ours['encoder_share']:.0%}) | {hf['elapsed_s']:.2f} s | {hf['comparison']['requests_per_s_ratio']:.2f}x | "
          f"{hf['comparison']['greedy_identical_requests']} | {ours['load_avg_1m_after']:.1f}, {hf['load_avg_1m_after']:.1f} |")
