#!/usr/bin/env bash
# stop_cluster.sh - stop exactly what start_cluster.sh started (PID files + its record of
# created namespaces/links in $BASE/created). Usage: stop_cluster.sh [--base DIR] [--purge]
set -uo pipefail
BASE=${SLC_BASE:-/tmp/slurm-local/cluster}
PURGE=0
while [ $# -gt 0 ]; do
  case "$1" in
    --base) BASE=$2; shift 2;;
    --base=*) BASE=${1#*=}; shift;;
    --purge) PURGE=1; shift;;
    *) echo "unknown arg $1" >&2; exit 2;;
  esac
done
[ -d "$BASE" ] || { echo "nothing to stop: $BASE does not exist"; exit 0; }
export SLURM_CONF=$BASE/etc/slurm.conf
say() { echo "[stop_cluster] $*" >&2; }

# alive PID [COMM]: running (zombies count as dead) and, if given, its command name is COMM
alive() {
  local st; [ -n "${1:-}" ] || return 1
  st=$(ps -o stat= -p "$1" 2>/dev/null) || return 1
  [ -n "$st" ] && [ "${st:0:1}" != Z ] || return 1
  [ -z "${2:-}" ] || [ "$(ps -o comm= -p "$1" 2>/dev/null)" = "$2" ]
}
# stop_group NAME=PIDFILE...: SIGTERM all of them at once, wait up to 20 s, then SIGKILL survivors
stop_group() {
  local item name pid pids=() names=()
  for item in "$@"; do
    name=${item%%=*}; [ -s "${item#*=}" ] || continue; pid=$(cat "${item#*=}")
    alive "$pid" "${name%%-*}" || continue      # skips dead pids and pids reused by other programs
    kill -TERM "$pid" 2>/dev/null; pids+=("$pid"); names+=("$name")
  done
  local i left
  for _ in $(seq 400); do
    left=0; for pid in "${pids[@]}"; do alive "$pid" && left=1; done
    [ $left = 0 ] && break; sleep 0.05
  done
  for i in "${!pids[@]}"; do
    if alive "${pids[$i]}"; then kill -KILL "${pids[$i]}" 2>/dev/null; say "killed ${names[$i]} (${pids[$i]})"
    else say "stopped ${names[$i]} (${pids[$i]})"; fi
  done
}
pidof_file() { [ -s "$1" ] && cat "$1"; }

# 1. cancel jobs while the controller is still up, give them a moment to be cleaned up
if alive "$(pidof_file "$BASE/pids/slurmctld.pid")" slurmctld; then
  jobs=$(squeue -h -o %A 2>/dev/null | tr '\n' ' ')
  if [ -n "${jobs// /}" ]; then
    say "cancelling jobs: $jobs"; scancel $jobs 2>/dev/null
    for _ in $(seq 150); do [ -z "$(squeue -h -o %A 2>/dev/null)" ] && break; sleep 0.1; done
  fi
fi

# 2. daemons in three waves (munge last: the others authenticate while shutting down)
group=()
for f in "$BASE"/pids/slurmd-*.pid; do [ -e "$f" ] && group+=("$(basename "$f" .pid)=$f"); done
stop_group "${group[@]}" "slurmctld=$BASE/pids/slurmctld.pid"
stop_group "slurmdbd=$BASE/pids/slurmdbd.pid"
stop_group "mariadbd=$BASE/pids/mariadbd.pid" "munged=$BASE/pids/munged.pid"

# 3. leftovers (job steps that survived their slurmd) live in namespaces we created: kill those PIDs
for f in "$BASE"/nodes/*/utsns; do
  [ -e "$f" ] || continue
  want=$(cat "$f")
  [ -n "$want" ] && [ "$want" != "$(readlink /proc/self/ns/uts)" ] || continue   # never the host's namespace
  for p in /proc/[0-9]*; do
    [ "$(readlink "$p/ns/uts" 2>/dev/null)" = "$want" ] || continue
    pid=${p#/proc/}; say "killing leftover pid $pid ($(cat "$p/comm" 2>/dev/null)) in $want"
    kill -KILL "$pid" 2>/dev/null
  done
done
if [ -f "$BASE/created" ]; then
  while read -r kind name; do
    [ "$kind" = netns ] || continue
    for pid in $(ip netns pids "$name" 2>/dev/null); do say "killing leftover pid $pid in netns $name"; kill -KILL "$pid" 2>/dev/null; done
  done < "$BASE/created"
fi

# 4. network objects and /etc/netns/* entries, newest first
if [ -f "$BASE/created" ]; then
  tac "$BASE/created" | while read -r kind name; do
    case "$kind" in
      netns)    ip netns del "$name" 2>/dev/null && say "deleted netns $name";;
      link)     ip link show "$name" >/dev/null 2>&1 && ip link del "$name" && say "deleted link $name";;
      etcnetns) case "$name" in /etc/netns/slc-*) rm -rf "$name"; rmdir /etc/netns 2>/dev/null;; esac;;
    esac
  done
  mv "$BASE/created" "$BASE/created.done"
fi
rm -f "$BASE"/munge/munge.socket.2* "$BASE"/pids/*.pid
if [ "$PURGE" = 1 ]; then rm -rf "$BASE"; say "removed $BASE"; else say "logs kept in $BASE/log"; fi
exit 0
