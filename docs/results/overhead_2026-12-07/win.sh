#!/bin/bash
# win.sh tag start end : symbol shares within [start,end) seconds of the recording
perf script -i ${OUT:-/tmp/overhead}/perf.$1.data -F time,ip,sym 2>/dev/null | awk -v a=$2 -v b=$3 '{t=$1+0; if(!s)s=t; k=t-s; if(k<a||k>=b) next; $1="";$2=""; sym=substr($0,3); sub(/\+0x[0-9a-f]+$/,"",sym); c[sym]++; n++} END{for(x in c) printf "%6.2f%% %s\n", 100*c[x]/n, x; print n, "samples" > "/dev/stderr"}' | sort -rn | head -${4:-30} | cut -c1-140
