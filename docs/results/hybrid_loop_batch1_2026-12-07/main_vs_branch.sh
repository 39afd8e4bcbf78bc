export OMP_NUM_THREADS=1 PAGEDLLM_CPU_THREADS=1
cd /tmp
for R in 1 2 3 4 5; do
for P in deepseek-v2-lite-200m qwen3-next-200m; do
for B in main wt-hybrid-loop; do
  echo "=== $P $B round $R"; uptime
  PYTHONPATH=/work/$B /work/main/.venv/bin/pagedllm bench throughput --preset $P --dtype float32 --num-prompts 1 --input-len 128 --output-len 128 --output-json hl_${P}_${B}_r$R.json 2>&1 | grep -E "output_tokens_per_s|elapsed_s"
done; done; done
uptime
