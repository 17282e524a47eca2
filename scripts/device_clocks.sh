# The card's power and SM clock during a device script's run (nvidia-smi dmon, 1 s samples), so
# that its numbers can be read against the state the card was in: an H100 at its 700 W limit ran
# its SM clock at 1605-1665 MHz instead of 1980 during MLA decode (docs/benchmarks.md, MLA
# section), and compute-heavy kernels slow down with it. Sourced, not run.
#
#   clocks_start FILE     starts the sampler in the background, output to FILE; it stops by
#                         itself after CLOCKS_MAX_S seconds (default 900). No nvidia-smi: no-op.
#   clocks_stop           stops it.
#   clocks_summary FILE   one line: samples, the highest power, the SM clock's range and the
#                         share of samples below its highest value.

CLOCKS_PID=

clocks_start() {
  command -v nvidia-smi > /dev/null || return 0
  timeout -k 2 "${CLOCKS_MAX_S:-900}" nvidia-smi dmon -s pc -d 1 > "$1" 2>&1 &
  CLOCKS_PID=$!
}

clocks_stop() {
  [[ -n $CLOCKS_PID ]] && kill "$CLOCKS_PID" 2> /dev/null
  CLOCKS_PID=
}

clocks_summary() {
  [[ -s $1 ]] || { echo "clocks: not sampled"; return 0; }
  # dmon's columns with -s pc: gpu, power W, gpu temp, memory temp, memory clock, SM clock.
  # Samples above 200 W count as under load (an idle card drops to ~345 MHz).
  awk '$1 ~ /^[0-9]+$/ && $2 ~ /^[0-9]+$/ && $6 ~ /^[0-9]+$/ {
         n++; if ($2 > pmax) pmax = $2; if ($6 > smax) smax = $6
         if ($2 >= 200) { m++; sm[m] = $6; if (m == 1 || $6 < smin) smin = $6 } }
       END {
         if (n == 0) { print "clocks: no samples"; exit }
         if (m == 0) { printf "clocks: %d samples, power max %d W, none above 200 W\n", n, pmax; exit }
         low = 0; for (i = 1; i <= m; i++) if (sm[i] < smax) low++
         printf "clocks: %d samples (%d above 200 W), power max %d W, SM clock under load %d-%d MHz, %d%% of those below %d\n",
                n, m, pmax, smin, smax, 100 * low / m, smax }' "$1"
}
