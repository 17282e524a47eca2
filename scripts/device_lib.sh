# Bounded steps for the device scripts (scripts/gpu-regression.sh, tests/bench/*_device_run.sh,
# tests/bench/stream_stress.sh). Sourced, not run. Every command runs under `timeout -k`, every
# wait for a daemon (to come up, to exit) has a limit, the logs are packed into the archive the
# call returns BEFORE each step starts (a call cut short still returns everything up to the step
# that was running, and says which one it was), and a step that overstays its limit gets a stack
# dump of its process and of every daemon alive (cuda-gdb, else gdb, else the kernel's view from
# /proc) saved into the logs before it is killed.
#
#   dl_init LOGS_DIR OUT_DIR ARCHIVE_NAME [DEADLINE_S]
#       LOGS_DIR: where the logs go; OUT_DIR/ARCHIVE_NAME: the archive (a .tgz); DEADLINE_S:
#       seconds from now after which no step starts and each step's limit is cut to what is
#       left (0: none), so the script ends, and packs, before the device call's own limit.
#   dl_step NAME            marks the start of a step: packs the logs first
#   dl_run NAME LIMIT_S CMD...
#       CMD's output to LOGS_DIR/NAME.log; returns its exit status (124 when it hung and was
#       killed; the stacks are in LOGS_DIR/stacks_NAME.txt)
#   dl_daemon_start NAME CMD...      CMD in the background (lifetime bounded by DL_DAEMON_MAX_S),
#                                    output to LOGS_DIR/NAME.log; sets DL_PID
#   dl_daemon_ready PID LIMIT_S PROBE...
#                                    polls PROBE (each try bounded) until it succeeds; 1 when the
#                                    daemon died or did not answer within LIMIT_S (stacks dumped)
#   dl_daemon_stop NAME PID GRACE_S  SIGTERM, then waits GRACE_S; still there: stacks, SIGKILL.
#                                    Sets DL_STOP ("exit code N" or "HUNG ...") and returns the
#                                    exit code (137 when it had to be killed)
#   dl_dump_stacks TAG PID...        the stacks of PIDs into LOGS_DIR/stacks_TAG.txt

DL_DAEMON_MAX_S=${DL_DAEMON_MAX_S:-900}
DL_DAEMONS=()

dl_init() {
  DL_LOGS=$1
  DL_OUT=$2
  DL_ARCHIVE=$3
  local deadline=${4:-0}
  mkdir -p "$DL_LOGS" "$DL_OUT"
  DL_DEADLINE=0
  [[ $deadline -gt 0 ]] && DL_DEADLINE=$((SECONDS + deadline))
  return 0
}

dl_pack() {
  tar -C "$DL_LOGS" -czf "$DL_OUT/$DL_ARCHIVE.tmp" . 2>/dev/null &&
    mv -f "$DL_OUT/$DL_ARCHIVE.tmp" "$DL_OUT/$DL_ARCHIVE"
}

dl_step() {
  echo "$1 (started at ${SECONDS} s)" > "$DL_LOGS/current_step"
  dl_pack
}

# The limit a step gets: LIMIT_S, cut to the time left before the deadline; 0 when no step
# should start any more.
dl_limit() {
  local limit=$1
  [[ $DL_DEADLINE -gt 0 ]] || { echo "$limit"; return; }
  local left=$((DL_DEADLINE - SECONDS - 20))
  if [[ $left -lt 10 ]]; then echo 0; elif [[ $left -lt $limit ]]; then echo "$left"; else echo "$limit"; fi
}

# True while PID runs (a zombie, exited and not yet reaped, does not count).
dl_alive() {
  local stat
  stat=$(cat "/proc/$1/stat" 2>/dev/null) || return 1
  stat=${stat##*) }
  [[ -n $stat && ${stat%% *} != Z ]]
}

# Waits up to SECONDS for PID to stop running; 0 when it did.
dl_wait_exit() {
  local pid=$1 tenths=$(($2 * 10))
  while dl_alive "$pid"; do
    [[ $tenths -le 0 ]] && return 1
    sleep 0.1
    tenths=$((tenths - 1))
  done
  return 0
}

# The direct children of PID.
dl_children() {
  if command -v pgrep > /dev/null; then
    pgrep -P "$1"
  else
    local parent=$1 stat fields
    for stat in /proc/[0-9]*/stat; do
      fields=$(cat "$stat" 2>/dev/null) || continue
      fields=${fields##*) }  # state ppid ...
      fields=${fields#* }
      [[ ${fields%% *} == "$parent" ]] && basename "$(dirname "$stat")"
    done
  fi
}

# PID, or the process `timeout` runs when PID is a `timeout` (the one worth a stack dump).
dl_target() {
  local pid=$1
  if [[ $(cat "/proc/$pid/comm" 2>/dev/null) == timeout ]]; then
    local child
    child=$(dl_children "$pid" | head -1)
    [[ -n $child ]] && pid=$child
  fi
  echo "$pid"
}

# The process a `timeout` started in the background (WRAPPER = its $!) runs, once it exists.
dl_spawned() {
  local wrapper=$1 tries=50 pid
  pid=$(dl_target "$wrapper")
  while [[ $pid == "$wrapper" && $tries -gt 0 ]] && dl_alive "$wrapper"; do
    sleep 0.1; tries=$((tries - 1)); pid=$(dl_target "$wrapper")
  done
  echo "$pid"
}

# Kills the daemons still registered (for an EXIT trap).
dl_kill_daemons() {
  local pid
  for pid in "${DL_DAEMONS[@]}"; do [[ -n $pid ]] && kill -KILL "$pid" 2>/dev/null; done
  DL_DAEMONS=()
}

dl_dump_stacks() {
  local tag=$1; shift
  local file="$DL_LOGS/stacks_$tag.txt"
  local pid
  for pid in "$@"; do
    pid=$(dl_target "$pid")
    {
      echo "===== pid $pid: $(tr '\0' ' ' < "/proc/$pid/cmdline" 2>/dev/null) ($(date -u +%T))"
      local dumped=0
      for debugger in cuda-gdb gdb; do
        command -v "$debugger" > /dev/null || continue
        echo "----- $debugger -batch -p $pid -ex 'thread apply all bt'"
        timeout -k 5 90 "$debugger" -batch -p "$pid" -ex 'set pagination off' \
          -ex 'thread apply all bt' 2>&1 | grep -v '^\[New LWP' | tee "$file.tmp"
        grep -q '^Thread ' "$file.tmp" && dumped=1
        rm -f "$file.tmp"
        [[ $dumped == 1 ]] && break
      done
      echo "----- /proc/$pid/status"
      cat "/proc/$pid/status" 2>&1
      echo "----- threads: tid comm state wchan (and the kernel stack where readable)"
      local task
      for task in /proc/"$pid"/task/*; do
        local state
        state=$(cat "$task/stat" 2>/dev/null); state=${state##*) }
        echo "$(basename "$task") $(cat "$task/comm" 2>/dev/null) ${state%% *} $(cat "$task/wchan" 2>/dev/null)"
        [[ $dumped == 1 ]] || sed 's/^/    /' "$task/stack" 2>/dev/null
      done
    } >> "$file" 2>&1
  done
  echo "stacks of $* saved in $(basename "$file")"
}

dl_run() {
  local name=$1 limit; shift
  limit=$(dl_limit "$1"); shift
  if [[ $limit == 0 ]]; then
    echo "SKIPPED: the deadline is near" > "$DL_LOGS/$name.log"
    return 125
  fi
  dl_step "$name"
  # timeout is the backstop; the watch below fires first, so that the stacks are taken while
  # the process still hangs.
  timeout -k 10 $((limit + 30)) "$@" > "$DL_LOGS/$name.log" 2>&1 &
  local watched=$!
  local rc
  if dl_wait_exit "$watched" "$limit"; then
    wait "$watched"; rc=$?
  else
    echo "HUNG: still running after ${limit} s; stacks, then SIGTERM, then SIGKILL" \
      >> "$DL_LOGS/$name.log"
    local target
    target=$(dl_target "$watched")
    dl_dump_stacks "$name" "$target" "${DL_DAEMONS[@]}" >> "$DL_LOGS/$name.log"
    kill -TERM "$target" 2>/dev/null
    dl_wait_exit "$watched" 10 || kill -KILL "$target" "$watched" 2>/dev/null
    wait "$watched" 2>/dev/null
    rc=124
  fi
  dl_pack
  return $rc
}

dl_daemon_start() {
  local name=$1; shift
  timeout -k 10 "$DL_DAEMON_MAX_S" "$@" > "$DL_LOGS/$name.log" 2>&1 &
  local watched=$!
  # Signal the daemon itself, not timeout.
  DL_PID=$(dl_spawned "$watched")
  DL_DAEMONS+=("$DL_PID")
  eval "DL_WRAPPER_$DL_PID=$watched"
}

dl_daemon_ready() {
  local pid=$1 limit=$2; shift 2
  local deadline=$((SECONDS + limit))
  while [[ $SECONDS -lt $deadline ]]; do
    dl_alive "$pid" || return 1
    timeout -k 2 5 "$@" > /dev/null 2>&1 && return 0
    sleep 0.2
  done
  dl_dump_stacks "not_ready_$pid" "$pid"
  return 1
}

dl_daemon_stop() {
  local name=$1 pid=$2 grace=$3
  local wrapper_var="DL_WRAPPER_$pid"
  local wrapper=${!wrapper_var:-}
  local rc
  local others=() other
  for other in "${DL_DAEMONS[@]}"; do [[ $other == "$pid" ]] || others+=("$other"); done
  DL_DAEMONS=("${others[@]}")
  kill -TERM "$pid" 2>/dev/null
  if dl_wait_exit "$pid" "$grace"; then
    if [[ -n $wrapper ]]; then wait "$wrapper" 2>/dev/null; rc=$?; else rc=0; fi
    DL_STOP="exit code $rc after SIGTERM"
  else
    dl_dump_stacks "$name" "$pid" > /dev/null
    kill -KILL "$pid" 2>/dev/null
    [[ -n $wrapper ]] && wait "$wrapper" 2>/dev/null
    rc=137
    DL_STOP="HUNG: still running ${grace} s after SIGTERM; stacks in stacks_$name.txt, killed"
  fi
  echo "$DL_STOP" >> "$DL_LOGS/$name.log"
  dl_pack
  return $rc
}
