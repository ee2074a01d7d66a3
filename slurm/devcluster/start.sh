#!/usr/bin/env bash
# Install, configure and start a Slurm cluster of one or several nodes on a Debian bookworm
# workstation or CI machine, as root, without systemd: munge, slurmctld, slurmd, slurmdbd + MariaDB (so `sacct`
# works), Open MPI with PMIx (so `srun --mpi=pmix` starts MPI ranks directly) and fake GPUs via gres
# (so GPU-shaped job specs such as `--gpus-per-node=2` schedule and set CUDA_VISIBLE_DEVICES).
#
# Idempotent: a second run installs nothing, starts only what is not running, restarts only the
# daemons whose configuration changed, and waits until the node is idle. Stale pid files left by a
# killed daemon or a rebooted container are detected (pid gone or owned by another program) and
# removed. Two concurrent runs are serialised by a lock file.
#
#   start.sh [--nodes N]     N=1 (default): one node, the machine itself (NodeAddr 127.0.0.1).
#                            N>1: N nodes node1..N, each slurmd in its own network + UTS namespace
#                            joined by a private bridge (netns.sh says how); slurmctld, slurmdbd
#                            and munge are shared. A run with another N reconfigures the cluster.
# Knobs (environment; the older SLURM_CI_<NAME> spelling of each is accepted as a fallback):
#   VERL_HPC_DEVCLUSTER_NODES=1        same as --nodes (the option wins)
#   VERL_HPC_DEVCLUSTER_SUBNET=10.213.7   /24 used inside the cluster's own namespaces only
#   VERL_HPC_DEVCLUSTER_LINK_RATE=2gbit   inter-node bandwidth (tc tbf); 0: unshaped
#   VERL_HPC_DEVCLUSTER_LINK_DELAY_US=200 inter-node latency (tc netem, where the kernel has it)
#   VERL_HPC_DEVCLUSTER_DBD=1          1: slurmdbd + MariaDB so `sacct` works (submitit needs it to
#                                      see jobs that die without writing a result); 0: no accounting
#   VERL_HPC_DEVCLUSTER_CPUS=8         CPUs advertised for the node (raised to nproc if lower;
#                                      more than nproc oversubscribes the real cores on purpose)
#   VERL_HPC_DEVCLUSTER_GPUS=4         fake GPUs (gres/gpu on /dev/fakegpuN = /dev/null); 0: none
#   VERL_HPC_DEVCLUSTER_MPI_DEFAULT=none   MpiDefault (pmix makes a bare `srun` MPI-capable)
#   VERL_HPC_DEVCLUSTER_PARTITION=debug
#   VERL_HPC_DEVCLUSTER_TIMEOUT=120    seconds to wait for each daemon and for the idle node
# Stop with slurm/devcluster/stop.sh (--purge also forgets jobs and accounting).
set -euo pipefail

knob() { # knob NAME DEFAULT -> $VERL_HPC_DEVCLUSTER_NAME, else $SLURM_CI_NAME, else DEFAULT
  local new="VERL_HPC_DEVCLUSTER_$1" old="SLURM_CI_$1"
  printf '%s' "${!new:-${!old:-$2}}"
}
DBD=$(knob DBD 1)
NODES=$(knob NODES 1)
while [ $# -gt 0 ]; do
  case "$1" in
    --nodes) NODES=${2:?--nodes needs a number}; shift 2 ;;
    --nodes=*) NODES=${1#--nodes=}; shift ;;
    -h|--help) sed -n '2,30p' "$0"; exit 0 ;;
    *) echo "usage: $0 [--nodes N]" >&2; exit 2 ;;
  esac
done
case "$NODES" in ''|*[!0-9]*|0) echo "[devcluster] ERROR: --nodes $NODES: expected a whole number >= 1" >&2; exit 2 ;; esac
SUBNET=$(knob SUBNET 10.213.7)
LINK_RATE=$(knob LINK_RATE 2gbit)
LINK_DELAY_US=$(knob LINK_DELAY_US 200)
NCPU_HW=$(nproc)
CPUS=$(knob CPUS 8); [ "$CPUS" -lt "$NCPU_HW" ] && CPUS=$NCPU_HW
GPUS=$(knob GPUS 4)
MPI_DEFAULT=$(knob MPI_DEFAULT none)
PART=$(knob PARTITION debug)
TMO=$(knob TIMEOUT 120)
CLUSTER=devcluster
H=$(hostname -s)
MEM=$(awk '/MemTotal/{print int($2/1024*0.8)}' /proc/meminfo)   # MB; leave 20% to the OS
T0=$(date +%s.%N)

log() { printf '[devcluster %6.1fs] %s\n' "$(awk -v a="$(date +%s.%N)" -v b="$T0" 'BEGIN{print a-b}')" "$*"; }
die() { echo "[devcluster] ERROR: $*" >&2; exit 1; }
wait_for() { # wait_for SECONDS CMD...
  local end=$(( $(date +%s) + $1 )); shift
  until "$@" >/dev/null 2>&1; do
    [ "$(date +%s)" -ge "$end" ] && { echo "[devcluster] timeout waiting for: $*" >&2; return 1; }
    sleep 0.5
  done
}
# alive NAME PIDFILE: true if the daemon NAME runs. A pid file is trusted only when its pid is
# alive AND that process is NAME (after a crash or a container restart the pid may be reused by
# an unrelated program). A stale pid file is removed; a daemon running without a pid file is
# found by its exact program name so we never start a second copy that fails on a busy port.
alive() {
  local name=$1 f=$2 pid
  if [ -s "$f" ]; then
    pid=$(cat "$f")
    if [ -r "/proc/$pid/comm" ] && [ "$(cat "/proc/$pid/comm")" = "$name" ]; then return 0; fi
    log "removing stale pid file $f (pid $pid is not $name)"
    rm -f "$f"
  fi
  pid=$(pgrep -x "$name" | head -n1 || true)
  if [ -n "$pid" ]; then echo "$pid" > "$f"; return 0; fi
  return 1
}
stop_daemon() { # stop_daemon NAME PIDFILE: used when a config file changed
  local pid
  alive "$1" "$2" || return 0
  pid=$(cat "$2"); kill "$pid"
  wait_for 30 sh -c "! kill -0 $pid" || kill -9 "$pid"
  rm -f "$2"
}
# install_if_changed SRC DEST: move SRC over DEST when they differ; print 1 if changed, else 0
install_if_changed() {
  if cmp -s "$1" "$2"; then rm -f "$1"; echo 0; else mv "$1" "$2"; echo 1; fi
}

[ "$(id -u)" = 0 ] || die "run as root (it installs packages and starts system daemons)"
command -v apt-get >/dev/null || die "needs a Debian/Ubuntu system with apt-get"

# Serialise concurrent runs (two test sessions starting the cluster at once).
install -d /run/verl_hpc
exec 9>/run/verl_hpc/devcluster.lock
flock -w "$TMO" 9 || die "another start.sh/stop.sh holds /run/verl_hpc/devcluster.lock"
# Daemons must not inherit the lock's descriptor, or the lock outlives this script.
spawn() { "$@" 9>&-; }
. "$(dirname "$0")/netns.sh"
# all slurmd pids (one per node in multi-node mode), from their pid files, else by exact name
slurmd_pids() {
  local f pid
  for f in /run/slurmd.pid /run/slurmd-node*.pid; do
    [ -s "$f" ] || continue
    pid=$(cat "$f"); [ -r "/proc/$pid/comm" ] && [ "$(cat "/proc/$pid/comm")" = slurmd ] && echo "$pid"
  done
  pgrep -x slurmd || true
}
stop_all_slurmd() {
  local pids; pids=$(slurmd_pids | sort -u | tr '\n' ' ')
  [ -n "${pids// }" ] || return 0
  kill $pids 2>/dev/null
  wait_for 30 sh -c "for p in $pids; do kill -0 \$p 2>/dev/null && exit 1; done; exit 0" || kill -9 $pids 2>/dev/null
  rm -f /run/slurmd.pid /run/slurmd-node*.pid
}

# ---------------------------------------------------------------- packages
# openmpi-bin/libopenmpi-dev: Open MPI 4.1 (mpicc for mpi4py/parallel h5py builds).
# libpmix2 is what Slurm's mpi/pmix plugin loads at `srun --mpi=pmix`; libpmix-dev is named
# explicitly because Slurm's mpi_pmix_v4.so dlopen()s the unversioned libpmix.so, which only the
# -dev package ships (libopenmpi-dev depends on it today; naming it keeps that from changing under
# us). hdf5-tools: h5ls/h5dump for checkpoint tests. prometheus-pushgateway: the tests push
# metrics to a real gateway they start themselves (the packaged service is not started).
# bubblewrap: the sandbox's bwrap mode, which the sandbox tests run (docs/sandbox.md); python3-minimal:
# the system Python the sandbox tests run as an unprivileged uid (the venv's may live under /root).
PKGS="slurmctld slurmd slurm-client munge openmpi-bin libopenmpi-dev libpmix-dev hdf5-tools prometheus-pushgateway bubblewrap python3-minimal"
# multi-node: ip netns/tc (iproute2), unshare/nsenter (util-linux), the controller forwarders (socat)
[ "$NODES" -gt 1 ] && PKGS="$PKGS iproute2 socat util-linux"
[ "$DBD" = 1 ] && PKGS="$PKGS slurmdbd mariadb-server"
missing=""
for p in $PKGS; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'ok installed' || missing="$missing $p"
done
if [ -n "$missing" ]; then
  log "installing:$missing"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq -o DPkg::Lock::Timeout=600
  apt-get install -y -qq -o DPkg::Lock::Timeout=600 --no-install-recommends $missing >/dev/null
fi
log "packages ok: $(dpkg-query -W -f='${Package}=${Version} ' slurmctld munge openmpi-bin libpmix2 hdf5-tools 2>/dev/null)"

# ---------------------------------------------------------------- host name
# Slurm resolves its own short host name; containers often lack an /etc/hosts entry for it.
getent hosts "$H" >/dev/null || echo "127.0.0.1 $H" >> /etc/hosts

# ---------------------------------------------------------------- munge
if [ ! -s /etc/munge/munge.key ]; then
  mungekey --create --keyfile=/etc/munge/munge.key 2>/dev/null \
    || dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 status=none
fi
chown munge:munge /etc/munge/munge.key; chmod 400 /etc/munge/munge.key
install -d -o munge -g munge -m 0755 /run/munge
install -d -o munge -g munge -m 0700 /var/lib/munge /var/log/munge
if ! alive munged /run/munge/munged.pid; then
  rm -f /run/munge/munge.socket.2*   # a stale socket/lock makes munged refuse to start
  spawn su -s /bin/sh munge -c /usr/sbin/munged
fi
wait_for "$TMO" sh -c 'munge -n | unmunge' || die "munged did not come up (see /var/log/munge/munged.log)"
log "munged up"

# ---------------------------------------------------------------- config
install -d /etc/slurm /var/spool/slurmctld /var/spool/slurmd /var/log/slurm
if [ "$DBD" = 1 ]; then
  ACCT="AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
AccountingStoragePort=6819
AccountingStorageTRES=gres/gpu
JobAcctGatherType=jobacct_gather/linux
JobAcctGatherFrequency=30"
else
  ACCT="AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none"
fi
GRES_NODE=""; GRES_TYPES=""
NEW_GRES=$(mktemp)
if [ "$GPUS" -gt 0 ]; then
  GRES_TYPES="GresTypes=gpu"; GRES_NODE="Gres=gpu:$GPUS"
  # Character devices with /dev/null's numbers: Slurm only needs a device file per GPU to
  # hand out; CUDA_VISIBLE_DEVICES is then set from the allocated indices.
  for ((i = 0; i < GPUS; i++)); do
    [ -e "/dev/fakegpu$i" ] || mknod "/dev/fakegpu$i" c 1 3 || die "mknod /dev/fakegpu$i failed (no CAP_MKNOD?); set VERL_HPC_DEVCLUSTER_GPUS=0"
  done
  echo "Name=gpu File=/dev/fakegpu[0-$((GPUS - 1))]" > "$NEW_GRES"
fi
if [ "$NODES" = 1 ]; then
  SLURMD_FILES="SlurmdSpoolDir=/var/spool/slurmd
SlurmdPidFile=/run/slurmd.pid
SlurmdLogFile=/var/log/slurm/slurmd.log"
  NODE_LINES="NodeName=${H} NodeAddr=127.0.0.1 CPUs=${CPUS} Sockets=1 CoresPerSocket=${CPUS} ThreadsPerCore=1 RealMemory=${MEM} ${GRES_NODE} State=UNKNOWN"
  NODE_NAMES=$H
else
  # one slurmd per node on one filesystem: %n (the node name) keeps their files apart
  SLURMD_FILES="SlurmdSpoolDir=/var/spool/slurmd/%n
SlurmdPidFile=/run/slurmd-%n.pid
SlurmdLogFile=/var/log/slurm/slurmd-%n.log
# PMIx puts each step's client directory under TmpFS: per node, or the second node's step
# fails with 'Cannot create directory /tmp/spmix_appdir_...: File exists'
TmpFS=/var/spool/slurmd/%n/tmp"
  NODE_LINES=""
  for ((k = 1; k <= NODES; k++)); do
    [ "$k" -gt 1 ] && NODE_LINES+=$'\n'
    NODE_LINES+="NodeName=node$k NodeAddr=$(node_addr "$k") CPUs=${CPUS} Sockets=1 CoresPerSocket=${CPUS} ThreadsPerCore=1 RealMemory=$((MEM / NODES)) ${GRES_NODE} State=UNKNOWN"
  done
  NODE_NAMES="node[1-$NODES]"
fi
NEW=$(mktemp)
cat > "$NEW" <<EOF
# generated by slurm/devcluster/start.sh -- development cluster of ${NODES} node(s)
ClusterName=${CLUSTER}
SlurmctldHost=${H}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
SlurmctldPort=6817
SlurmdPort=6818
StateSaveLocation=/var/spool/slurmctld
SlurmctldPidFile=/run/slurmctld.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
${SLURMD_FILES}
SlurmctldDebug=info
SlurmdDebug=info
MailProg=/bin/true
# No cgroups without systemd: track processes by parent pid and bind nothing.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=${MPI_DEFAULT}
${ACCT}
JobCompType=jobcomp/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
# Trust the CPU count below rather than the hardware, so 8 one-CPU ranks fit on 2 cores.
SlurmdParameters=config_overrides
${GRES_TYPES}
ReturnToService=2
KillWait=5
InactiveLimit=0
MinJobAge=300
${NODE_LINES}
PartitionName=${PART} Nodes=ALL Default=YES MaxTime=INFINITE State=UP
# Preemption, for tests of the stop/requeue rule: a job in 'scavenger' (PriorityTier 0) is
# preempted by a job of any other partition that needs its CPUs: SIGTERM at once, requeued by Slurm
# after GraceTime. Nothing outranks the default partition, so its jobs are never preempted.
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
PartitionName=scavenger Nodes=ALL MaxTime=INFINITE State=UP PriorityTier=0 GraceTime=60
EOF
CHANGED=$(install_if_changed "$NEW" /etc/slurm/slurm.conf)
chmod 644 /etc/slurm/slurm.conf
if [ "$GPUS" -gt 0 ]; then
  [ "$(install_if_changed "$NEW_GRES" /etc/slurm/gres.conf)" = 1 ] && CHANGED=1
  chmod 644 /etc/slurm/gres.conf
else
  rm -f "$NEW_GRES"
  [ -e /etc/slurm/gres.conf ] && { rm -f /etc/slurm/gres.conf; CHANGED=1; }
fi
# slurmctld refuses to start on state saved under another ClusterName (e.g. left by an older
# script): keep that state aside instead of failing.
if [ -s /var/spool/slurmctld/clustername ] && [ "$(cat /var/spool/slurmctld/clustername)" != "$CLUSTER" ]; then
  old=/var/spool/slurmctld.$(cat /var/spool/slurmctld/clustername).$(date +%s)
  log "state in /var/spool/slurmctld belongs to another cluster name; moved to $old"
  stop_daemon slurmctld /run/slurmctld.pid
  mv /var/spool/slurmctld "$old"; install -d /var/spool/slurmctld
fi

# ---------------------------------------------------------------- slurmdbd + MariaDB
if [ "$DBD" = 1 ]; then
  cat > /etc/mysql/mariadb.conf.d/60-slurmdbd.cnf <<'EOF'
[mysqld]
innodb_buffer_pool_size=256M
innodb_lock_wait_timeout=900
EOF
  if ! mysqladmin ping >/dev/null 2>&1; then
    # A killed mysqld leaves its pid file and socket behind; the init script copes with the
    # pid file, a leftover socket only needs removing.
    rm -f /run/mysqld/mysqld.sock /run/mysqld/mysqld.sock.lock
    spawn /etc/init.d/mariadb start >/dev/null
  fi
  wait_for "$TMO" mysqladmin ping || die "MariaDB did not come up (see /var/log/mysql/error.log or syslog)"
  mysql -uroot <<'EOF'
CREATE DATABASE IF NOT EXISTS slurm_acct_db;
CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY 'slurmdevcluster';
ALTER USER 'slurm'@'localhost' IDENTIFIED BY 'slurmdevcluster';
GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost';
FLUSH PRIVILEGES;
EOF
  log "mariadb up"
  NEW=$(mktemp)
  cat > "$NEW" <<'EOF'
AuthType=auth/munge
DbdHost=localhost
DbdPort=6819
SlurmUser=root
PidFile=/run/slurmdbd.pid
LogFile=/var/log/slurm/slurmdbd.log
DebugLevel=info
StorageType=accounting_storage/mysql
StorageHost=localhost
StoragePort=3306
StorageLoc=slurm_acct_db
StorageUser=slurm
StoragePass=slurmdevcluster
EOF
  # slurmdbd insists on a config readable by its user only (it holds the DB password).
  chmod 600 "$NEW"
  if [ "$(install_if_changed "$NEW" /etc/slurm/slurmdbd.conf)" = 1 ]; then
    stop_daemon slurmdbd /run/slurmdbd.pid
  fi
  alive slurmdbd /run/slurmdbd.pid || spawn slurmdbd
  wait_for "$TMO" sacctmgr -n list cluster || die "slurmdbd did not come up (see /var/log/slurm/slurmdbd.log)"
  log "slurmdbd up"
else
  stop_daemon slurmdbd /run/slurmdbd.pid
fi

# ---------------------------------------------------------------- slurmctld + slurmd
if [ "$CHANGED" = 1 ]; then
  stop_all_slurmd
  stop_daemon slurmctld /run/slurmctld.pid
fi
if [ "$NODES" = 1 ]; then
  # a multi-node cluster ran before: its namespaces, forwarders and hosts lines go
  if [ -d "$NET_RUN" ] || ip netns list 2>/dev/null | grep -q "^${NS_HEAD}\b"; then
    stop_all_slurmd; stop_daemon slurmctld /run/slurmctld.pid; net_down; rm -rf "$NET_RUN"  # its forwarders' logs too
    log "multi-node network removed"
  fi
  alive slurmctld /run/slurmctld.pid || spawn slurmctld
  wait_for "$TMO" scontrol ping || die "slurmctld did not come up (see /var/log/slurm/slurmctld.log)"
  alive slurmd /run/slurmd.pid || spawn slurmd
else
  # a single-node slurmd (root namespace) or nodes beyond N left from a larger cluster go first
  if [ -s /run/slurmd.pid ] || ip netns list | grep -q "^${NS_PREFIX}$((NODES + 1))\b"; then
    stop_all_slurmd; stop_daemon slurmctld /run/slurmctld.pid; net_down
  fi
  # slurmctld must run inside the head namespace: one in the root namespace goes
  if alive slurmctld /run/slurmctld.pid && [ "$(readlink /proc/"$(cat /run/slurmctld.pid)"/ns/net)" != "net:[$(stat -L -c %i "/run/netns/$NS_HEAD" 2>/dev/null)]" ]; then
    stop_daemon slurmctld /run/slurmctld.pid
  fi
  net_up "$NODES"
  alive slurmctld /run/slurmctld.pid || spawn nsenter --net="/run/netns/$NS_HEAD" slurmctld
  wait_for "$TMO" scontrol ping || die "slurmctld did not come up (see /var/log/slurm/slurmctld.log, $NET_RUN/*.log)"
  for ((k = 1; k <= NODES; k++)); do node_slurmd_up "$k"; done
  shaped=unshaped; [ "$LINK_RATE" = 0 ] || shaped="$LINK_RATE"
  if tc -n "$NS_HEAD" qdisc show dev vhn1 | grep -q netem; then shaped+=", ${LINK_DELAY_US} us"; else shaped+=", latency not shaped (no netem in this kernel)"; fi
  log "network: $NODES node namespaces on ${SUBNET}.0/24, inter-node links $shaped"
fi
log "slurmctld/slurmd up"

# ---------------------------------------------------------------- wait for an idle node
end=$(( $(date +%s) + TMO ))
while :; do
  # every node usable (sinfo prints one line per node with -N)
  states=$(sinfo -h -N -n "$NODE_NAMES" -o '%N %T' 2>/dev/null || true)
  bad=$(echo "$states" | awk '$2 !~ /^(idle|mixed|allocated|completing)$/ {print $1}')
  st=$(echo "$states" | awk '{print $2}' | sort -u | paste -sd, -)
  [ -n "$states" ] && [ -z "$bad" ] && break
  for b in $bad; do
    case "$(echo "$states" | awk -v n="$b" '$1 == n {print $2}')" in
      down*|drain*|inval*|fail*) scontrol update nodename="$b" state=resume 2>/dev/null || true ;;
    esac
  done
  if [ "$(date +%s)" -ge "$end" ]; then
    echo "[devcluster] node(s) ${bad:-$NODE_NAMES} not usable after ${TMO}s (states: $states)" >&2
    sinfo -R >&2 || true
    tail -n 20 /var/log/slurm/slurmctld.log /var/log/slurm/slurmd*.log >&2 || true
    exit 1
  fi
  sleep 0.5
done
sinfo -o '%P %a %T %D %c %m %G %N'
# Smoke test: one PMIx step end to end (munge credential, slurmd launch, PMIx server in slurmd).
# A node that reports idle but cannot run steps would otherwise make every later srun hang.
# Skipped when other jobs fill the node (it then evidently runs jobs; the step would only queue).
# Multi-node: one task per node, started from node1 (srun must reach every slurmd and the
# machine's own namespace has no route to them); every node must answer with its own host name.
case "$st" in
  idle|mixed)
    if [ "$NODES" = 1 ]; then
      spawn timeout 60 srun --job-name=devcluster-smoke -N1 -n1 --mpi=pmix true \
        || die "srun --mpi=pmix smoke step failed (srun --mpi=list: $(srun --mpi=list 2>&1 | tr -s ' \n\t' ' '))"
    else
      got=$(spawn timeout 90 nsenter --net=/run/netns/"$(node_ns 1)" srun --job-name=devcluster-smoke -N"$NODES" \
              --ntasks-per-node=1 --mpi=pmix hostname | sort | paste -sd, -) \
        || die "srun --mpi=pmix smoke step over $NODES nodes failed (see /var/log/slurm/slurmd-node*.log)"
      want=$(for ((k = 1; k <= NODES; k++)); do echo "node$k"; done | sort | paste -sd, -)
      [ "$got" = "$want" ] || die "smoke step ran on '$got', expected '$want'"
    fi ;;
  *) log "nodes $st with other jobs: smoke step skipped" ;;
esac
acct=off; [ "$DBD" = 1 ] && acct="on (sacct)"
log "READY: cluster '$CLUSTER', $NODES node(s) $NODE_NAMES $st, partition $PART, $CPUS CPUs + $GPUS fake GPUs per node, accounting $acct; stop with slurm/devcluster/stop.sh"
