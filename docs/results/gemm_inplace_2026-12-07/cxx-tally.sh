#!/bin/sh
exec g++ -DPAGEDLLM_GEMM_TALLY "$@"
