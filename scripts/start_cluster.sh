#!/usr/bin/env bash
# start_cluster.sh - slurm-grpo test cluster: a real, throw-away Slurm cluster on ONE Debian machine (as root),
# each slurmd in its own network namespace with fake GPUs as GRES (derived from shared/slurm/ recipe).
#
# Usage: start_cluster.sh [NODES] [GPUS_PER_NODE] [options]
#   NODES            number of compute nodes n1..nN (default 2)
#   GPUS_PER_NODE    fake GPUs per node, declared as GRES gpu (default 4; 0 = no GRES)
# Options (or the env var in brackets):
#   --mode netns|ports   [SLC_MODE]  netns (default): each slurmd in its own network+UTS namespace,
#                                    own IP 10.200.0.(10+i) on a private bridge, hostname = node name.
#                        ports: all slurmd share the host network (one port each, NodeAddr 127.0.2.i),
#                                    each in its own UTS+mount namespace (hostname = node name).
#   --accounting | --no-accounting   [SLC_ACCOUNTING=1|0] run MariaDB + slurmdbd so that `sacct`
#                                    works (submitit polls sacct for job states). Default: 1.
#   --cpus C          [SLC_CPUS]     CPUs declared per node (default 4, oversubscribing is fine)
#   --mem MB          [SLC_MEM_MB]   RealMemory per node (default 4096)
#   --base DIR        [SLC_BASE]     state/log/config dir (default /tmp/slurm-local/cluster)
#   --no-install                     fail instead of apt-get installing missing packages
#   --restart-node NODE              on the running cluster of --base: start NODE's slurmd again (in the node's
#                                    namespaces, as at start-up) unless it is alive, and wait until NODE is idle
#                                    (a test that killed a whole node puts the cluster back with this)
# Prints `export SLURM_CONF=...` etc. and writes the same to $BASE/env.sh (with every node's address and, in netns
# mode, its network namespace: SLC_NODE_ADDRS, SLC_NODE_NETNS). Stop with stop_cluster.sh (same --base / SLC_BASE).
set -euo pipefail

T0=$(date +%s%N)
NODES=""; GPUS=""
MODE=${SLC_MODE:-netns}
ACCOUNTING=${SLC_ACCOUNTING:-1}
CPUS=${SLC_CPUS:-4}
MEM=${SLC_MEM_MB:-4096}
BASE=${SLC_BASE:-/tmp/slurm-local/cluster}
INSTALL=1
RESTART_NODE=""
while [ $# -gt 0 ]; do
  case "$1" in
    --mode) MODE=$2; shift 2;;
    --mode=*) MODE=${1#*=}; shift;;
    --accounting) ACCOUNTING=1; shift;;
    --no-accounting) ACCOUNTING=0; shift;;
    --cpus) CPUS=$2; shift 2;;
    --mem) MEM=$2; shift 2;;
    --base) BASE=$2; shift 2;;
    --base=*) BASE=${1#*=}; shift;;
    --no-install) INSTALL=0; shift;;
    --restart-node) RESTART_NODE=$2; shift 2;;
    --restart-node=*) RESTART_NODE=${1#*=}; shift;;
    -h|--help) sed -n '2,23p' "$0"; exit 0;;
    -*) echo "unknown option $1" >&2; exit 2;;
    *) if [ -z "$NODES" ]; then NODES=$1; elif [ -z "$GPUS" ]; then GPUS=$1; else echo "extra arg $1" >&2; exit 2; fi; shift;;
  esac
done
NODES=${NODES:-${SLC_NODES:-2}}
GPUS=${GPUS:-${SLC_GPUS:-4}}
case "$MODE" in netns|ports) ;; *) echo "--mode must be netns or ports" >&2; exit 2;; esac
[ "$(id -u)" = 0 ] || { echo "must run as root" >&2; exit 1; }
[ "$NODES" -ge 1 ] && [ "$NODES" -le 200 ] || { echo "NODES must be 1..200" >&2; exit 2; }

PFX=slc                      # prefix of every netns / link we create
BR=${PFX}br0
BR_ADDR=10.200.0.1
CTLD_PORT=16817
SLURMD_PORT=16818            # netns mode: same port in every namespace
PORT_BASE=17000              # ports mode: node i listens on PORT_BASE+i
DBD_PORT=16819
MYSQL_PORT=16806
elapsed() { local d=$(( ($(date +%s%N) - T0) / 1000000 )); printf '%d.%03d' $((d / 1000)) $((d % 1000)); }
log() { echo "[start_cluster $(elapsed)s] $*" >&2; }
addr_of() { if [ "$MODE" = netns ]; then echo "10.200.0.$((10 + $1))"; else echo "127.0.2.$1"; fi; }

# start_slurmd I: node nI's slurmd, in a new UTS namespace (hostname = node name) and a private mount namespace in
# which $BASE/etc/hosts (node names -> node addresses) is bind-mounted over /etc/hosts; the host's /etc/hosts is
# untouched. netns mode: also the node's network namespace (entered with nsenter, not `ip netns exec`, which would
# remount /sys and hide the cgroup mounts slurmd wants to see).
start_slurmd() {
  local node=n$1 enter=()
  local inner="echo $node > /proc/sys/kernel/hostname && mount --bind $BASE/etc/hosts /etc/hosts && exec slurmd -f $SLURM_CONF -N $node"
  [ "$MODE" = netns ] && enter=(nsenter "--net=/run/netns/$PFX-$node" --)
  "${enter[@]}" unshare --uts --mount --propagation private -- sh -c "$inner"
}
# record_slurmd I: wait for nI's slurmd pid file, and remember the node's private UTS namespace
# (stop_cluster.sh kills leftovers found in it)
record_slurmd() {
  local i=$1 uts
  for _ in $(seq 100); do [ -s "$BASE/pids/slurmd-n$i.pid" ] && break; sleep 0.1; done
  [ -s "$BASE/pids/slurmd-n$i.pid" ] || { echo "slurmd n$i did not start, see $BASE/log/slurmd-n$i.log" >&2; return 1; }
  uts=$(readlink "/proc/$(cat "$BASE/pids/slurmd-n$i.pid")/ns/uts" || true)
  if [ -n "$uts" ] && [ "$uts" != "$(readlink /proc/self/ns/uts)" ]; then echo "$uts" > "$BASE/nodes/n$i/utsns"; fi
}

# ---------------------------------------------------------------- --restart-node: one node of a running cluster
if [ -n "$RESTART_NODE" ]; then
  BASE=${BASE%/}
  [ -f "$BASE/.slurm-local-cluster" ] && [ -f "$BASE/etc/slurm.conf" ] || { echo "no cluster in $BASE (start_cluster.sh makes one)" >&2; exit 1; }
  MODE=$(cat "$BASE/mode"); export SLURM_CONF=$BASE/etc/slurm.conf
  i=${RESTART_NODE#n}
  case "$i" in ''|*[!0-9]*) echo "--restart-node $RESTART_NODE: give a node name n1..n$(cat "$BASE/nodecount")" >&2; exit 2;; esac
  [ "$i" -ge 1 ] && [ "$i" -le "$(cat "$BASE/nodecount")" ] || { echo "--restart-node $RESTART_NODE: the cluster has n1..n$(cat "$BASE/nodecount")" >&2; exit 2; }
  scontrol ping 2>/dev/null | grep -q UP || { echo "slurmctld of $BASE is not answering; restart the whole cluster" >&2; exit 1; }
  pid=$(cat "$BASE/pids/slurmd-n$i.pid" 2>/dev/null || true)
  if [ -n "$pid" ] && [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = slurmd ]; then
    log "slurmd n$i is running (pid $pid)"
  else
    rm -f "$BASE/pids/slurmd-n$i.pid"
    start_slurmd "$i"
    record_slurmd "$i"
    log "slurmd n$i started (pid $(cat "$BASE/pids/slurmd-n$i.pid"))"
  fi
  # the controller returns a node that answers again to service (ReturnToService=2); a node drained for a job
  # that could not be killed (its slurmd was gone) is resumed by hand
  for t in $(seq 1200); do
    st=$(sinfo -h -n "n$i" -N -o '%T' 2>/dev/null | head -n1 || true)
    [ "$st" = idle ] && { log "n$i idle"; exit 0; }
    case "$st" in drain*|drained*|down) [ $((t % 20)) = 0 ] && { scontrol update NodeName="n$i" State=RESUME 2>/dev/null || true; };; esac
    sleep 0.1
  done
  echo "n$i did not become idle in 120 s (state: ${st:-unknown}); see $BASE/log/slurmd-n$i.log and slurmctld.log" >&2
  exit 1
fi

# ---------------------------------------------------------------- refuse double start / clean stale state
case "$BASE" in /*/*) ;; *) echo "--base must be an absolute path below a top-level dir" >&2; exit 2;; esac
BASE=${BASE%/}
if [ -e "$BASE" ] && [ ! -e "$BASE/.slurm-local-cluster" ] && [ -n "$(ls -A "$BASE" 2>/dev/null)" ]; then
  echo "$BASE exists, is not empty and was not made by this script; refusing to use it" >&2; exit 1
fi
if [ -d "$BASE/pids" ]; then
  for f in "$BASE"/pids/*.pid; do
    [ -e "$f" ] || continue
    n=$(basename "$f" .pid); st=$(ps -o stat=,comm= -p "$(cat "$f")" 2>/dev/null || true)
    if [ -n "$st" ] && [ "${st:0:1}" != Z ] && [ "${st##* }" = "${n%%-*}" ]; then
      echo "a cluster seems to be running from $BASE ($f alive); run stop_cluster.sh first" >&2; exit 1
    fi
  done
fi
# a previous cluster whose processes were killed (not stopped) leaves namespaces/links behind
if [ -f "$BASE/created" ]; then
  echo "[start_cluster] cleaning up a previous, unstopped cluster in $BASE" >&2
  SLC_BASE=$BASE "$(cd "$(dirname "$0")" && pwd)/stop_cluster.sh" >&2 || true
fi
if [ "$MODE" = netns ] && ip link show "$BR" >/dev/null 2>&1; then
  echo "link $BR already exists (another cluster with a different --base?); stop it first" >&2; exit 1
fi

# ---------------------------------------------------------------- install
need=()
for b in slurmctld:slurmctld slurmd:slurmd sbatch:slurm-client munged:munge unshare:util-linux; do
  command -v "${b%%:*}" >/dev/null 2>&1 || need+=("${b#*:}")
done
[ "$MODE" = netns ] && { command -v ip >/dev/null 2>&1 || need+=(iproute2); }
if [ "$ACCOUNTING" = 1 ]; then
  command -v slurmdbd >/dev/null 2>&1 || need+=(slurmdbd)
  [ -x /usr/sbin/mariadbd ] || need+=(mariadb-server-core)
  command -v mariadb >/dev/null 2>&1 || need+=(mariadb-client-core)
fi
if [ ${#need[@]} -gt 0 ]; then
  [ "$INSTALL" = 1 ] || { echo "missing packages: ${need[*]}" >&2; exit 1; }
  echo "[start_cluster] installing: ${need[*]}" >&2
  export DEBIAN_FRONTEND=noninteractive
  # keep package postinst scripts from starting system services (we run our own instances)
  made_policy=0
  if [ ! -e /usr/sbin/policy-rc.d ]; then printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d; chmod 755 /usr/sbin/policy-rc.d; made_policy=1; fi
  ls /var/lib/apt/lists/*_Packages >/dev/null 2>&1 || apt-get update -q >&2
  # SLC_APT_OPTS: extra apt-get options, e.g. "-o Dir::Cache::Archives=/some/empty/dir"
  apt-get install -y -q --no-install-recommends ${SLC_APT_OPTS:-} "${need[@]}" >&2 || { [ $made_policy = 1 ] && rm -f /usr/sbin/policy-rc.d; exit 1; }
  [ $made_policy = 1 ] && rm -f /usr/sbin/policy-rc.d
fi
T_INSTALLED=$(elapsed)
log "packages ready"

# ---------------------------------------------------------------- layout
# on any failure from here on, undo whatever was already started
HERE=$(cd "$(dirname "$0")" && pwd)
cleanup_on_fail() {
  rc=$?
  if [ $rc != 0 ]; then
    echo "[start_cluster] FAILED (rc=$rc); logs: $BASE/log; cleaning up" >&2
    tail -n 20 "$BASE"/log/*.log >&2 2>/dev/null || true
    SLC_BASE=$BASE "$HERE/stop_cluster.sh" >&2 || true
  fi
}
trap cleanup_on_fail EXIT
rm -rf "$BASE"
mkdir -p "$BASE"/{etc,pids,ctld/state,log,munge}
touch "$BASE/.slurm-local-cluster"
chmod 755 "$BASE" "$BASE/munge"
NODELIST="n[1-$NODES]"; [ "$NODES" = 1 ] && NODELIST=n1
echo "$MODE" > "$BASE/mode"
echo "$NODES" > "$BASE/nodecount"

# ---------------------------------------------------------------- munge (own key, own socket)
MSOCK=$BASE/munge/munge.socket.2
dd if=/dev/urandom of="$BASE/munge/munge.key" bs=1024 count=1 status=none
chmod 400 "$BASE/munge/munge.key"
munged --key-file="$BASE/munge/munge.key" --socket="$MSOCK" --pid-file="$BASE/pids/munged.pid" \
       --log-file="$BASE/log/munged.log" --seed-file="$BASE/munge/munged.seed" --num-threads=4
for _ in $(seq 50); do [ -S "$MSOCK" ] && [ -s "$BASE/pids/munged.pid" ] && break; sleep 0.1; done
munge -S "$MSOCK" -n | unmunge -S "$MSOCK" >/dev/null
log "munged up (pid $(cat "$BASE/pids/munged.pid"))"

# ---------------------------------------------------------------- network / namespaces
if [ "$MODE" = netns ]; then
  [ "$NODES" -le 240 ] || { echo "netns mode supports <=240 nodes" >&2; exit 2; }
  CTLD_ADDR=$BR_ADDR
  ip link add "$BR" type bridge
  ip addr add "$BR_ADDR/24" dev "$BR"
  ip link set "$BR" up
  echo "link $BR" >> "$BASE/created"
  for i in $(seq "$NODES"); do
    ns=$PFX-n$i
    ip netns add "$ns"; echo "netns $ns" >> "$BASE/created"
    ip link add "${PFX}v$i" type veth peer name eth0 netns "$ns"
    echo "link ${PFX}v$i" >> "$BASE/created"
    ip link set "${PFX}v$i" master "$BR" up
    ip -n "$ns" link set lo up
    ip -n "$ns" addr add "$(addr_of "$i")/24" dev eth0
    ip -n "$ns" link set eth0 up            # deliberately no default route: nothing can leave
  done
else
  CTLD_ADDR=127.0.0.1
fi

# hosts file seen inside every node: node names -> node addresses (the host's /etc/hosts is untouched)
{ grep -v -E '(^|\s)n[0-9]+(\s|$)' /etc/hosts || true
  echo "# slurm-local-cluster nodes"
  [ "$MODE" = netns ] && echo "$BR_ADDR slurmctld-host"
  for i in $(seq "$NODES"); do echo "$(addr_of "$i") n$i"; done; } > "$BASE/etc/hosts"

# ---------------------------------------------------------------- fake GPUs + config
GRES_LINE=""
if [ "$GPUS" -gt 0 ]; then
  GRES_LINE="Gres=gpu:$GPUS"
  : > "$BASE/etc/gres.conf"
  for i in $(seq "$NODES"); do
    mkdir -p "$BASE/nodes/n$i/dev"
    for g in $(seq 0 $((GPUS - 1))); do
      mknod "$BASE/nodes/n$i/dev/nvidia$g" c 1 3   # behaves like /dev/null
    done
    echo "NodeName=n$i Name=gpu File=$BASE/nodes/n$i/dev/nvidia[0-$((GPUS - 1))]" >> "$BASE/etc/gres.conf"
  done
fi
for i in $(seq "$NODES"); do mkdir -p "$BASE/nodes/n$i/spool"; done

if [ "$MODE" = netns ]; then
  NODE_LINES=""
  for i in $(seq "$NODES"); do
    NODE_LINES+="NodeName=n$i NodeAddr=$(addr_of "$i") NodeHostname=n$i Port=$SLURMD_PORT CPUs=$CPUS RealMemory=$MEM $GRES_LINE State=UNKNOWN"$'\n'
  done
else
  NODE_LINES=""
  for i in $(seq "$NODES"); do
    NODE_LINES+="NodeName=n$i NodeAddr=$(addr_of "$i") NodeHostname=n$i Port=$((PORT_BASE + i)) CPUs=$CPUS RealMemory=$MEM $GRES_LINE State=UNKNOWN"$'\n'
  done
fi

ACCT_LINES="AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none"
if [ "$ACCOUNTING" = 1 ]; then
  ACCT_LINES="AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
AccountingStoragePort=$DBD_PORT
AccountingStoragePass=$MSOCK
AccountingStorageTRES=gres/gpu
JobAcctGatherType=jobacct_gather/none"
fi

# Job ids would restart at 1 on every fresh cluster, so folders keyed by %j (submitit!) would find the
# previous run's result files. Start each cluster at a time-derived id instead (advances 100/s; < MaxJobId).
FIRST_JOB_ID=${SLC_FIRST_JOB_ID:-$(( ($(date +%s) % 600000) * 100 + 1000 ))}
cat > "$BASE/etc/slurm.conf" <<EOF
# generated by start_cluster.sh ($MODE mode, $NODES nodes, $GPUS fake GPUs/node)
ClusterName=localcluster
FirstJobId=$FIRST_JOB_ID
SlurmctldHost=localhost($CTLD_ADDR)
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$MSOCK
StateSaveLocation=$BASE/ctld/state
SlurmdSpoolDir=$BASE/nodes/%n/spool
SlurmctldPidFile=$BASE/pids/slurmctld.pid
SlurmdPidFile=$BASE/pids/slurmd-%n.pid
SlurmctldLogFile=$BASE/log/slurmctld.log
SlurmdLogFile=$BASE/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
# default batch_sched_delay=3 made sbatch->running take 1-3 s; 0 gives ~0.5-0.8 s
SchedulerParameters=batch_sched_delay=0
MailProg=/bin/true
PriorityType=priority/basic
MpiDefault=none
ReturnToService=2
SlurmdParameters=config_overrides
SlurmdTimeout=60
InactiveLimit=0
KillWait=5
MinJobAge=300
TmpFS=/tmp
GresTypes=gpu
$ACCT_LINES
$NODE_LINES
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
EOF
export SLURM_CONF=$BASE/etc/slurm.conf

# ---------------------------------------------------------------- accounting: MariaDB + slurmdbd
if [ "$ACCOUNTING" = 1 ]; then
  DB=$BASE/mysql; mkdir -p "$DB/data" "$DB/run"
  # mariadbd runs as root (explicit user=root): no mysql system user needed (mariadb-server-core only)
  mariadb-install-db --user=root --datadir="$DB/data" --auth-root-authentication-method=socket \
      --skip-test-db > "$BASE/log/mariadb-install.log" 2>&1
  cat > "$DB/my.cnf" <<EOF
[mysqld]
user=root
datadir=$DB/data
socket=$DB/run/mysqld.sock
pid-file=$DB/run/mariadbd.pid
log-error=$DB/run/mariadbd.log
bind-address=127.0.0.1
port=$MYSQL_PORT
skip-name-resolve
innodb_buffer_pool_size=64M
innodb_log_file_size=16M
innodb_lock_wait_timeout=900
EOF
  chmod 644 "$DB/my.cnf"
  MYSQLD=$(command -v mariadbd || echo /usr/sbin/mariadbd)
  # mariadbd stays in the foreground; we background it and record its pid file
  nohup "$MYSQLD" --defaults-file="$DB/my.cnf" > "$BASE/log/mariadbd.stdout" 2>&1 < /dev/null &
  echo $! > "$BASE/pids/mariadbd.pid"
  ln -s "$DB/run/mariadbd.log" "$BASE/log/mariadbd.log"
  for _ in $(seq 150); do [ -S "$DB/run/mysqld.sock" ] && break; sleep 0.1; done
  [ -S "$DB/run/mysqld.sock" ] || { echo "mariadbd did not start, see $BASE/log/mariadbd.log" >&2; exit 1; }
  mariadb --socket="$DB/run/mysqld.sock" -uroot <<EOF
CREATE DATABASE slurm_acct_db;
CREATE USER 'slurm'@'127.0.0.1' IDENTIFIED BY 'slurmpw';
GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';
FLUSH PRIVILEGES;
EOF
  log "mariadbd up (pid $(cat "$BASE/pids/mariadbd.pid"))"
  cat > "$BASE/etc/slurmdbd.conf" <<EOF
AuthType=auth/munge
AuthInfo=socket=$MSOCK
DbdHost=localhost
DbdPort=$DBD_PORT
SlurmUser=root
PidFile=$BASE/pids/slurmdbd.pid
LogFile=$BASE/log/slurmdbd.log
DebugLevel=info
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$MYSQL_PORT
StorageLoc=slurm_acct_db
StorageUser=slurm
StoragePass=slurmpw
EOF
  chmod 600 "$BASE/etc/slurmdbd.conf"
  slurmdbd      # reads slurmdbd.conf from the directory of $SLURM_CONF
  for _ in $(seq 100); do sacctmgr -i -n list cluster >/dev/null 2>&1 && break; sleep 0.1; done
  sacctmgr -i add cluster localcluster >/dev/null
  log "slurmdbd up (pid $(cat "$BASE/pids/slurmdbd.pid"))"
fi

# ---------------------------------------------------------------- slurmctld
slurmctld -f "$SLURM_CONF"
for _ in $(seq 100); do scontrol ping 2>/dev/null | grep -q UP && break; sleep 0.1; done
scontrol ping | grep -q UP || { echo "slurmctld not answering, see $BASE/log/slurmctld.log" >&2; exit 1; }
log "slurmctld up (pid $(cat "$BASE/pids/slurmctld.pid"))"

# ---------------------------------------------------------------- slurmd per node
for i in $(seq "$NODES"); do start_slurmd "$i"; done
for i in $(seq "$NODES"); do record_slurmd "$i"; done
log "slurmd started for $NODELIST"

# ---------------------------------------------------------------- wait for idle
ok=0
for _ in $(seq 600); do
  idle=$(sinfo -h -N -o '%N %T' 2>/dev/null | awk '$2=="idle"' | wc -l)
  if [ "$idle" -ge "$NODES" ]; then ok=1; break; fi
  sleep 0.1
done
if [ $ok != 1 ]; then sinfo -N -l >&2; echo "nodes did not become idle; logs in $BASE/log" >&2; exit 1; fi
T_UP=$(elapsed)

cat > "$BASE/env.sh" <<EOF
export SLURM_CONF=$SLURM_CONF
export SLC_BASE=$BASE
export SLC_MODE=$MODE
export SLC_NODES=$NODES
export SLC_GPUS_PER_NODE=$GPUS
export SLC_NODELIST='$NODELIST'
export SLC_PARTITION=debug
export SLC_ACCOUNTING=$ACCOUNTING
export SLC_NODE_ADDRS='$(for i in $(seq "$NODES"); do printf 'n%s=%s ' "$i" "$(addr_of "$i")"; done | sed 's/ $//')'
export SLC_NODE_NETNS='$([ "$MODE" = netns ] && for i in $(seq "$NODES"); do printf 'n%s=/run/netns/%s ' "$i" "$PFX-n$i"; done | sed 's/ $//')'
# MASTER_ADDR inside a job: the first node name, e.g. \$(scontrol show hostnames "\$SLURM_JOB_NODELIST" | head -n1)
# resolves (node-local /etc/hosts) to $(addr_of 1) and is reachable from every node.
EOF
log "cluster up: $NODES nodes idle (install done at ${T_INSTALLED}s, cluster up at ${T_UP}s)"
sinfo -N -o '%N %T %c %m %G' >&2
cat "$BASE/env.sh"
