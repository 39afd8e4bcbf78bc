#!/usr/bin/env bash
# `pagedllm bench serve` against the same server in-process and with --multiprocess-mode (the
# engine core in its own process), one after the other in one invocation: streamed requests at
# concurrency 64 on the shipped model (CPU). The ratio of the two runs goes to docs/distributed.md.
# Also prints the CPU seconds the server process (front end) and its engine-core child spent
# during each benchmark (from /proc), to show where the time goes.
# Usage: bash scripts/bench_multiprocess_serve.sh [OUT_DIR] [NUM_PROMPTS]
#   (default docs/results/multiprocess, 256 prompts of 64 input and 64 output tokens)
set -u
out=${1:-docs/results/multiprocess}
num_prompts=${2:-256}
mkdir -p "$out"
py=${PYTHON:-python}
port=$($py -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
tick=$(getconf CLK_TCK)

cpu_s() {  # CPU seconds (user + system) of pid $1
    awk -v t="$tick" '{ print ($14 + $15) / t }' "/proc/$1/stat" 2>/dev/null || echo 0
}

core_pid() {  # the server's engine-core child (multiprocessing spawn), if any
    for c in $(cat /proc/"$1"/task/*/children 2>/dev/null); do
        grep -qa spawn_main "/proc/$c/cmdline" 2>/dev/null && { echo "$c"; return; }
    done
}

for mode in no-multiprocess-mode multiprocess-mode; do
    $py -m pagedllm.entrypoints.cli serve --port "$port" --uvicorn-log-level warning \
        --"$mode" >"$out/server-$mode.log" 2>&1 &
    server=$!
    for _ in $(seq 600); do
        curl -sf "http://127.0.0.1:$port/health" >/dev/null && break
        sleep 0.5
    done
    core=$(core_pid "$server")
    front0=$(cpu_s "$server"); core0=$([ -n "$core" ] && cpu_s "$core" || echo 0)
    $py -m pagedllm.entrypoints.cli bench serve --base-url "http://127.0.0.1:$port" \
        --num-prompts "$num_prompts" --max-concurrency 64 --input-len 64 --output-len 64 \
        --output-json "$out/$mode.json" | tee "$out/bench-$mode.txt"
    front1=$(cpu_s "$server"); core1=$([ -n "$core" ] && cpu_s "$core" || echo 0)
    echo "cpu_s during the benchmark ($mode): server process $(echo "$front1 - $front0" | bc)," \
         "engine-core process $(echo "$core1 - $core0" | bc)" | tee -a "$out/bench-$mode.txt"
    kill -TERM "$server"
    wait "$server"
done
