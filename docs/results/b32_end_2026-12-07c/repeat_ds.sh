# DeepSeek float32 batch 32 against HF, three more `bench throughput --compare hf` runs in a row
# (one thread each), to see how far the ratio moves between runs on this VM. ROUNDS (default
# "1 2 3") and OUT_DIR (default: this folder) may be set.
export OMP_NUM_THREADS=1 PAGEDLLM_CPU_THREADS=1
D=${OUT_DIR:-$(dirname "$0")}
for R in ${ROUNDS:-1 2 3}; do
  echo "== round $R: $(uptime)"
  python -c "import sys; from pagedllm.entrypoints.cli import main; sys.argv[0] = 'pagedllm'; sys.exit(main())" \
    bench throughput --preset deepseek-v2-lite-200m --dtype float32 --num-prompts 32 \
    --input-len 128 --output-len 128 --compare hf --output-json $D/deepseek-v2-lite-200m_32x128_float32_repeat$R.json
done
