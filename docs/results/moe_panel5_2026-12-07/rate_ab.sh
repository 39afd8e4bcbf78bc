# Per-op A/B of the routed experts (plan + expert_phases of fused_moe_kernel.h, one thread) at the
# presets' prefill shapes: the library built from OLD's csrc (A) and from this checkout's (B),
# loaded into one process and alternated (rate_main.cpp); NL=4 copies of the weights are cycled
# so that they come from memory, as in a model's forward pass; STEP tokens per step (1365: a third of
# 32 x 128 prompt tokens; the engine's default steps are 2048). Output: rate_ab.txt (T=1365),
# rate_ab_2048.txt.
#   OLD=/work/main [STEP=2048] bash rate_ab.sh
set -e
HERE=$(cd "$(dirname "$0")" && pwd)
NEW=$(cd "$HERE/../../.." && pwd)
OLD=${OLD:-/work/main}
TMP=${TMP:-/tmp/moepanel-rate}
mkdir -p "$TMP/abi"
PYTHONPATH=$NEW python -c "from pagedllm.native.kernels import abi; open('$TMP/abi/pagedllm_abi.h','w').write(abi.c_header())"
for TREE in old new; do
  SRC=$([ $TREE = old ] && echo "$OLD" || echo "$NEW")/pagedllm/native/kernels/csrc
  g++ -O3 -march=native -fopenmp -shared -fPIC -std=c++17 -I"$SRC" -I"$TMP/abi" "$HERE/rate_lib.cpp" -o "$TMP/$TREE.so"
done
g++ -O2 "$HERE/rate_main.cpp" -o "$TMP/rate_main" -ldl
export OMP_NUM_THREADS=1 NL=4
for P in ds qn; do for BF in 0 1; do
  "$TMP/rate_main" $P $BF ${ROUNDS:-5} ${REPS:-6} "$TMP/old.so" "$TMP/new.so" ${STEP:-1365}
done; done
