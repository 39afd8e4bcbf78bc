#!/usr/bin/env bash
# `pagedllm bench serve` against the same server in-process and with --multiprocess-mode (the
# engine core in its own process), alternating (in-process, multiprocess, in-process, ...) for
# ROUNDS rounds in one invocation: streamed requests at concurrency 64 on the shipped model (CPU).
# On a shared machine the load changes between runs; alternating and repeating lets the ratio
# be read per round (each in-process run against the multiprocess run right after it).
# Prints, per run, the load average before it, the CPU seconds (user + system, from /proc) of
# every process of the server during the benchmark (front end, engine core) and of the
# benchmark client itself (which shares the machine's cores), to show where the time goes, and
# the CPU seconds each of the server's busiest threads used during it ("pid/tid": a process's
# main thread has tid = pid: the event loop of the API server, the engine core's step loop).
# Usage: bash scripts/bench_multiprocess_serve.sh [OUT_DIR] [NUM_PROMPTS] [ROUNDS] [FLAGS...]
#   (default docs/results/multiprocess, 128 prompts of 64 input and 64 output tokens, 2 rounds;
#   FLAGS: extra `pagedllm serve` flags for the multiprocess runs, e.g. --api-server-count 2)
set -u
out=${1:-docs/results/multiprocess}
num_prompts=${2:-128}
rounds=${3:-2}
shift $(( $# < 3 ? $# : 3 ))
mp_flags=("$@")
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

thread_cpu() {  # "pid/tid cpu_s" of every thread of the tree of $1 (user + system)
    for p in $(tree "$1"); do
        for t in /proc/"$p"/task/*; do
            awk -v k="$tick" -v n="$p/${t##*/}" \
                '{ sub(/^.*\) /, ""); printf "%s %.2f\n", n, ($12 + $13) / k }' "$t/stat" \
                2>/dev/null
        done
    done
}

thread_delta() {  # "pid/tid:cpu_s" used between snapshot $1 and snapshot $2, busiest first
    awk 'NR == FNR { before[$1] = $2; next } { printf "%s:%.2f\n", $1, $2 - before[$1] }' \
        <(echo "$1") <(echo "$2") | sort -t: -k2 -rn | head -6 | tr '\n' ' '
}

for round in $(seq "$rounds"); do
    for mode in in-process multiprocess; do
        case $mode in
            in-process) flags=(--no-multiprocess-mode) ;;
            multiprocess) flags=(--multiprocess-mode "${mp_flags[@]}") ;;
        esac
        tag="$mode-$round"
        $py -m pagedllm.entrypoints.cli serve --port "$port" --uvicorn-log-level warning \
            "${flags[@]}" >"$out/server-$tag.log" 2>&1 &
        server=$!
        for _ in $(seq 1200); do
            curl -sf "http://127.0.0.1:$port/health" >/dev/null && break
            sleep 0.5
        done
        sleep 2
        load=$(cut -d" " -f1-3 /proc/loadavg)
        before=$(cpu_report "$server")
        threads_before=$(thread_cpu "$server")
        /usr/bin/time -f "bench client cpu_s: %U user + %S system" \
            $py -m pagedllm.entrypoints.cli bench serve --base-url "http://127.0.0.1:$port" \
            --num-prompts "$num_prompts" --max-concurrency 64 --input-len 64 --output-len 64 \
            --output-json "$out/$tag.json" >"$out/bench-$tag.txt" 2>&1
        after=$(cpu_report "$server")
        threads=$(thread_delta "$threads_before" "$(thread_cpu "$server")")
        {
            echo "load average before ($tag): $load"
            echo "cpu_s before ($tag): $before"
            echo "cpu_s after ($tag): $after"
            echo "thread cpu_s during ($tag): $threads"
        } >>"$out/bench-$tag.txt"
        kill -TERM "$server"
        wait "$server"
        echo "server exit status ($tag): $?" >>"$out/bench-$tag.txt"
        grep -E "output_tokens_per_s|tpot_ms_p50|itl_ms_p99|load average before|cpu_s|client" \
            "$out/bench-$tag.txt" | sed "s/^/[$tag] /"
    done
done
