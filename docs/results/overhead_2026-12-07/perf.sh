#!/bin/bash
# usage: perf.sh PRESET DT tag
rm -f ${OUT:-/tmp/overhead}/pid.$3
DT=$2 nice -n 5 ${PYTHON:-python} $(dirname $0)/perfrun.py $1 128 ${OUT:-/tmp/overhead}/pid.$3 > ${OUT:-/tmp/overhead}/log.$3 2>&1 &
PY=$!
while [ ! -s ${OUT:-/tmp/overhead}/pid.$3 ]; do sleep 1; done
perf record -F 999 -p $(cat ${OUT:-/tmp/overhead}/pid.$3) -o ${OUT:-/tmp/overhead}/perf.$3.data 2>/dev/null &
PERF=$!
wait $PY
kill -INT $PERF; wait $PERF
perf report -i ${OUT:-/tmp/overhead}/perf.$3.data --no-children --sort symbol 2>/dev/null | grep -v "^#" | grep -v "^$" | head -45 > ${OUT:-/tmp/overhead}/report.$3.txt
