#!/bin/bash
# A command longer than one device call (10 minutes), run across calls: `start` launches it in a process session of
# its own (setsid), which the device keeps running between calls while the machine stays warm, beside a sampler of
# the host's free memory; each call (`start`, then `poll`) waits up to POLL_S seconds (default 540), prints the
# last lines of WATCH (e.g. the run's metrics.jsonl) and of the command's log, and copies what the command wrote
# under $W/out, its log and the memory samples to $OUT. Issue the next `poll` at once: the machine goes back after
# 30 s idle, and the command with it.
#
#   W=/tmp/job WATCH=runs/x/metrics.jsonl bash experiments/studies/long_run.sh start python train.py --out /tmp/job/out/x.json
#   W=/tmp/job WATCH=runs/x/metrics.jsonl bash experiments/studies/long_run.sh poll
#
# The command should write its results under $W/out ($JOB_OUT in its environment). A `start` while a command is in
# flight polls that one instead. `poll` ends "done: exit N" once the command has ended, "still running" before.
set -u
W=${W:?set W to the folder of the job, e.g. /tmp/job}
mode=${1:-poll}
[ $# -gt 0 ] && shift

sample() {
  while true; do echo "t=$(date +%s) $(grep -E '^(MemAvailable|Dirty):' /proc/meminfo | tr -s ' ' | tr '\n' ' ')"
    sleep 5; done
}

case $mode in
  start)
    [ $# -gt 0 ] || { echo "start needs the command"; exit 2; }
    mkdir -p "$W/out"
    if [ -f "$W/job.pid" ] && [ ! -f "$W/job.done" ] && kill -0 "$(cat "$W/job.pid")" 2>/dev/null; then
      echo "a command is in flight ($(cat "$W/job.cmd")): polling it"
    else
      rm -f "$W/job.done" "${WATCH:-/nonexistent}"
      printf '%q ' "$@" > "$W/job.cmd"
      JOB_OUT="$W/out" setsid nohup bash -c "$(declare -f sample); sample > '$W/mem.log' 2>&1 & S=\$!
        $(cat "$W/job.cmd"); rc=\$?; kill \$S; echo \$rc > '$W/job.done'" > "$W/job.log" 2>&1 < /dev/null &
      echo $! > "$W/job.pid"
      echo "started: $(cat "$W/job.cmd")"
    fi
    exec bash "$0" poll ;;
  poll)
    end=$(( $(date +%s) + ${POLL_S:-540} ))
    while [ ! -f "$W/job.done" ] && [ "$(date +%s)" -lt "$end" ]; do sleep 1; done
    [ -n "${WATCH:-}" ] && [ -f "$WATCH" ] && tail -n 3 "$WATCH" | cut -c1-300
    tail -n 1 "$W/mem.log" 2>/dev/null
    tail -n 4 "$W/job.log" 2>/dev/null | cut -c1-400
    mkdir -p "${OUT:-/tmp/out}"
    cp -r "$W/out/." "${OUT:-/tmp/out}/" 2>/dev/null
    cp "$W/job.log" "$W/mem.log" "${OUT:-/tmp/out}/" 2>/dev/null
    [ -n "${WATCH:-}" ] && [ -f "$WATCH" ] && cp "$WATCH" "${OUT:-/tmp/out}/"
    if [ -f "$W/job.done" ]; then
      echo "done: exit $(cat "$W/job.done")"
    else
      echo "still running: poll again now (the machine goes back after 30 s idle)"
    fi ;;
  *) echo "usage: W=DIR bash $0 start CMD... | poll"; exit 2 ;;
esac
