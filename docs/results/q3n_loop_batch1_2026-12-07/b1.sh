#!/bin/bash
# qwen3-next-200m at batch 1 against llama.cpp in the same run, alternating two checkouts
# (this change and main) round by round. Run from this folder:
#   BRANCH=/path/to/checkout MAIN=/path/to/main-checkout ROUNDS="1 2 3" ./b1.sh
# Needs llama-cpp-python (PAGEDLLM_LLAMACPP_SITE_PACKAGES) and the preset's F32 GGUF written
# first with `PYTHONPATH=. python scripts/write_preset_gguf.py qwen3-next-200m`.
export OMP_NUM_THREADS=1 PAGEDLLM_CPU_THREADS=1
PY=${PY:-python}
for R in ${ROUNDS:-1 2 3}; do
  for B in ${BUILDS:-branch main}; do
    if [ "$B" = branch ]; then CHECKOUT=$BRANCH; else CHECKOUT=$MAIN; fi
    echo "round $R $B $(uptime)"
    PYTHONPATH=$CHECKOUT $PY -m pagedllm.entrypoints.cli bench throughput \
      --preset qwen3-next-200m --dtype float32 --num-prompts 1 --input-len 128 \
      --output-len 128 --compare llamacpp --llamacpp-threads 1 \
      --output-json qwen3-next-200m_${B}_r$R.json
    echo "end $(uptime)"
  done
done
