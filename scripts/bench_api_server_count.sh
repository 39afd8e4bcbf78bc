#!/usr/bin/env bash
# `pagedllm bench serve` against the same model served three ways, one after the other in one
# invocation: in-process, --multiprocess-mode (one API server, the engine core in its own
# process) and --api-server-count 2 (two API servers on one port over that core). Streamed
# requests at concurrency 64 on the shipped model (CPU). Prints the CPU seconds every process of
# the server spent during each benchmark (from /proc), to show where the time goes.
# Usage: bash scripts/bench_api_server_count.sh [OUT_DIR] [NUM_PROMPTS]
#   (default docs/results/api_server_count, 256 prompts of 64 input and 64 output tokens)
set -u
out=${1:-docs/results/api_server_count}
num_prompts=${2:-256}
mkdir -p "$out"
py=${PYTHON:-python}
port=$($py -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
tick=$(getconf CLK_TCK)

tree() {  # pid $1 and its descendants
    echo "$1"
    for c in $(cat /proc/"$1"/task/*/children 2>/dev/null); do tree "$c"; done
}

cpu_report() {  # "pid:cpu_s" of every process of the tree of $1 (user + system)
    for p in $(tree "$1"); do
        awk -v t="$tick" -v p="$p" '{ printf "%s:%.2f ", p, ($14 + $15) / t }' \
            "/proc/$p/stat" 2>/dev/null
    done
}

for mode in in-process multiprocess api-server-count-2; do
    case $mode in
        in-process) flags="--no-multiprocess-mode" ;;
        multiprocess) flags="--multiprocess-mode" ;;
        api-server-count-2) flags="--api-server-count 2" ;;
    esac
    $py -m pagedllm.entrypoints.cli serve --port "$port" --uvicorn-log-level warning $flags \
        >"$out/server-$mode.log" 2>&1 &
    server=$!
    for _ in $(seq 1200); do
        curl -sf "http://127.0.0.1:$port/health" >/dev/null && break
        sleep 0.5
    done
    sleep 2
    before=$(cpu_report "$server")
    $py -m pagedllm.entrypoints.cli bench serve --base-url "http://127.0.0.1:$port" \
        --num-prompts "$num_prompts" --max-concurrency 64 --input-len 64 --output-len 64 \
        --output-json "$out/$mode.json" | tee "$out/bench-$mode.txt"
    after=$(cpu_report "$server")
    echo "cpu_s before ($mode): $before" | tee -a "$out/bench-$mode.txt"
    echo "cpu_s after ($mode): $after" | tee -a "$out/bench-$mode.txt"
    kill -TERM "$server"
    wait "$server"
    echo "server exit status ($mode): $?" | tee -a "$out/bench-$mode.txt"
done
