#!/usr/bin/env bash
# Shutdown and cancellation under load, many times over (issue 18): each round starts a fresh
# attnd, runs one attnctl bench case (the e2e cases of scripts/gpu-regression.sh) and ends it
# one way:
#   full        the bench runs to its end, then attnd gets SIGTERM
#   client_kill attnctl is SIGKILLed mid-stream (the client vanishes), then attnd gets SIGTERM
#   client_int  attnctl gets SIGINT mid-stream: it must cancel its streams, print what it
#               measured and exit within 10 s; then attnd gets SIGTERM
#   daemon_term attnd gets SIGTERM with streams in flight: the bench must end (with an error)
#               and attnd must exit within its drain and exit grace
# Every wait is bounded (scripts/device_lib.sh); a hang leaves both processes' stacks in the
# logs and fails the run.
#
#   ATTND="build/server/attnd" ATTNCTL="build/client/attnctl" tests/bench/stream_stress.sh ROUNDS
#   (on the GPU machine: ATTND="$B/run attnd" ATTNCTL="$B/run attnctl" ATTND_STRESS_BACKEND=cuda
#    ATTND_STRESS_SHAPE=gpu)
# Output: a line per round and a summary on stdout; logs in $OUT/stress_logs.tgz. Exit status 1
# when any round hung or misbehaved.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
source "$here/../../scripts/device_lib.sh"
rounds=${1:-24}
read -r -a attnd <<< "${ATTND:-build/server/attnd}"
read -r -a attnctl <<< "${ATTNCTL:-build/client/attnctl}"
backend=${ATTND_STRESS_BACKEND:-cpu}
out=${OUT:-/tmp/stream-stress}
logs=${ATTND_STRESS_LOGS:-/tmp/stream-stress-logs}
rm -rf "$logs"
dl_init "$logs" "$out" stress_logs.tgz "${ATTND_STRESS_DEADLINE_S:-0}"
trap dl_kill_daemons EXIT
drain_s=5
exit_s=5
# Shorter than attnd's own watchdog (drain + exit + 10 s), so that a hang's stacks are taken
# before the watchdog ends the process.
stop_grace_s=$((drain_s + exit_s + 7))
port=${ATTND_STRESS_PORT:-50661}

if [[ ${ATTND_STRESS_SHAPE:-cpu} == gpu ]]; then
  # The e2e shape of PERFORMANCE.md, with more steps so that an interruption lands mid-run.
  shape=(--sequences=128 --layers=32 --qo_heads=32 --kv_heads=8 --head_dim=128 --page_size=16
         --prompt_tokens=64 --warmup_steps=1)
  steps_full=10
  steps_long=400
  mixed=512
else
  # CPU-sized: the same structure (GQA, several layers, micro-batches) in milliseconds per step.
  shape=(--sequences=8 --layers=4 --qo_heads=4 --kv_heads=2 --head_dim=64 --page_size=16
         --prompt_tokens=16 --warmup_steps=1)
  steps_full=10
  steps_long=3000
  mixed=32
fi
cases=(
  "stream_w1 --stream --window=1"
  "stream_mb2_w4 --stream --micro_batches=2 --window=4"
  "unary_w1"
  "stream_mb2_w2 --stream --micro_batches=2 --window=2"
  "stream_w1_mixed --stream --window=1 --prefill_tokens=$mixed"
  "stream_mb2_w2_msg --stream --micro_batches=2 --window=2 --raw=false"
  "unary_mb2_w2 --micro_batches=2 --window=2"
)
scenarios=(full client_kill client_int daemon_term)

failures=0
declare -A tally
RANDOM=${ATTND_STRESS_SEED:-18}

for ((round = 0; round < rounds; ++round)); do
  read -r -a spec <<< "${cases[round % ${#cases[@]}]}"
  name=${spec[0]}
  args=("${spec[@]:1}")
  scenario=${scenarios[(round / ${#cases[@]}) % ${#scenarios[@]}]}
  tag="r${round}_${name}_${scenario}"
  [[ $(dl_limit 60) == 0 ]] && { echo "deadline: stopping after $round rounds"; break; }
  dl_step "$tag"
  server=127.0.0.1:$port
  dl_daemon_start "attnd_$tag" "${attnd[@]}" --backend="$backend" --listen_address="$server" \
    --metrics_address= --drain_grace=${drain_s}s --exit_grace=${exit_s}s
  daemon=$DL_PID
  if ! dl_daemon_ready "$daemon" 60 "${attnctl[@]}" --server="$server" --timeout=2s health; then
    echo "$tag: attnd not ready"; failures=$((failures + 1))
    dl_daemon_stop "attnd_$tag" "$daemon" 5 > /dev/null
    port=$((port + 1)); continue
  fi
  steps=$steps_long
  [[ $scenario == full ]] && steps=$steps_full
  bench_log="$logs/attnctl_$tag.log"
  timeout -k 10 120 "${attnctl[@]}" --server="$server" bench "${shape[@]}" --steps=$steps \
    "${args[@]}" > "$bench_log" 2>&1 &
  bench_wrapper=$!
  bench=$(dl_spawned "$bench_wrapper")
  problems=()
  delay="0.$((RANDOM % 9 + 1))"
  case $scenario in
    full)
      limit=90 ;;
    client_kill)
      sleep "$delay"; sleep $((RANDOM % 2)); kill -KILL "$bench" 2>/dev/null; limit=10 ;;
    client_int)
      sleep "$delay"; sleep $((RANDOM % 2)); kill -INT "$bench" 2>/dev/null; limit=10 ;;
    daemon_term)
      sleep "$delay"; sleep $((RANDOM % 2)); kill -TERM "$daemon" 2>/dev/null
      limit=$((stop_grace_s + 10)) ;;
  esac
  started=$SECONDS
  if dl_wait_exit "$bench_wrapper" "$limit"; then
    wait "$bench_wrapper" 2>/dev/null; bench_rc=$?
  else
    echo "HUNG: attnctl still running ${limit} s after the $scenario action" >> "$bench_log"
    dl_dump_stacks "$tag" "$bench" "$daemon" > /dev/null
    kill -KILL "$bench" 2>/dev/null; wait "$bench_wrapper" 2>/dev/null
    bench_rc=hung; problems+=("attnctl HUNG (stacks_$tag.txt)")
  fi
  bench_s=$((SECONDS - started))
  case $scenario in
    full)
      [[ $bench_rc == 0 ]] && grep -q '^RESULT' "$bench_log" ||
        problems+=("attnctl rc=$bench_rc, expected 0 and a RESULT line") ;;
    client_int)
      # Interrupted: exit 130, having printed what it measured (when the signal came before the
      # timed steps there is nothing to print).
      [[ $bench_rc == 130 ]] && grep -q 'stopping (cancelling' "$bench_log" ||
        problems+=("attnctl rc=$bench_rc after SIGINT, expected 130 and its message") ;;
    daemon_term)
      # The bench fails (its steps refused or cut short) or, signalled late, ends; a crash on
      # the way out (134: attnctl aborted in gRPC's teardown, seen before the client library
      # pinned the callback queue) fails the round.
      [[ $bench_rc == 0 || $bench_rc == 1 ]] ||
        problems+=("attnctl rc=$bench_rc after attnd's SIGTERM, expected 0 or 1") ;;
  esac
  # daemon_term: the SIGTERM was sent already; a second one exits attnd at once, so wait on.
  if [[ $scenario == daemon_term ]]; then
    dl_wait_exit "$daemon" "$stop_grace_s"
    dl_daemon_stop "attnd_$tag" "$daemon" 1 > /dev/null; stop_rc=$?
  else
    dl_daemon_stop "attnd_$tag" "$daemon" "$stop_grace_s" > /dev/null; stop_rc=$?
  fi
  [[ $stop_rc == 0 ]] || problems+=("attnd: $DL_STOP")
  verdict=ok
  if [[ ${#problems[@]} -gt 0 ]]; then
    verdict=$(IFS=';'; echo "FAIL: ${problems[*]}")
    failures=$((failures + 1))
  fi
  tally[$scenario]=$((${tally[$scenario]:-0} + 1))
  echo "$tag: attnctl rc=$bench_rc in ${bench_s}s, attnd ${DL_STOP}: $verdict" | tee -a "$logs/rounds.txt"
  port=$((port + 1))
done
for scenario in "${!tally[@]}"; do echo "rounds $scenario: ${tally[$scenario]}"; done
echo "stress: $failures failure(s) in $round round(s)" | tee -a "$logs/rounds.txt"
dl_pack
[[ $failures == 0 ]]
