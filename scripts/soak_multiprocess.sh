#!/usr/bin/env bash
# `pagedllm bench soak` (2,000 requests at concurrency 64, seed 0, shipped model, 2 MiB KV cache
# so requests are preempted) against the multi-process servers, one after the other:
#   core       --multiprocess-mode (the engine core in its own process)
#   dp2        -dp 2 --multiprocess-mode (two engine-core processes behind one router)
#   pool2      --api-server-count 2 (two API-server processes on one port, one engine core)
# The JSON of each run goes to OUT_DIR/soak-2000-<name>.json and its log to .log; the figures
# are in docs/reliability.md. Usage: bash scripts/soak_multiprocess.sh [OUT_DIR] [NAMES...]
set -u
out=${1:-docs/results/multiprocess}
shift || true
names=${*:-core dp2 pool2}
mkdir -p "$out"
py=${PYTHON:-python}
status=0
for name in $names; do
    case $name in
        core) args=(--serve-arg=--multiprocess-mode) ;;
        dp2) args=(--serve-arg=--multiprocess-mode --serve-arg=--data-parallel-size=2) ;;
        pool2) args=(--serve-arg=--api-server-count=2) ;;
        *) echo "unknown run $name" >&2; exit 2 ;;
    esac
    echo "== soak $name: ${args[*]}"
    $py -m pagedllm.entrypoints.cli bench soak --num-requests 2000 --concurrency 64 \
        "${args[@]}" --output-json "$out/soak-2000-$name.json" >"$out/soak-2000-$name.log" 2>&1
    code=$?
    echo "   exit $code; $(grep -E 'passed|FAILED|failed' "$out/soak-2000-$name.log" | tail -2)"
    [ "$code" = 0 ] || status=1
done
exit $status
