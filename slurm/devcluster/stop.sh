#!/usr/bin/env bash
# Stop the development cluster started by slurm/devcluster/start.sh: cancel jobs, then stop
# slurmd (one per node), slurmctld, slurmdbd, MariaDB and munged; for a multi-node cluster also
# its socat forwarders, network namespaces (with their links and addresses) and /etc/hosts lines.
# Safe to run when nothing runs.
#   --purge : also wipe Slurm state (job ids restart at 1) and the accounting database
# Packages and configuration files stay; start.sh brings everything back in seconds.
set -uo pipefail
PURGE=0
case "${1:-}" in
  --purge) PURGE=1 ;;
  "") ;;
  -h|--help) sed -n '2,5p' "$0"; exit 0 ;;
  *) echo "usage: $0 [--purge]" >&2; exit 2 ;;
esac
[ "$(id -u)" = 0 ] || { echo "[devcluster] run as root" >&2; exit 1; }

install -d /run/verl_hpc
exec 9>/run/verl_hpc/devcluster.lock
flock -w 120 9 || { echo "[devcluster] another start.sh/stop.sh holds the lock" >&2; exit 1; }
spawn() { "$@" 9>&-; }
. "$(dirname "$0")/netns.sh"

# stop_pid NAME PIDFILE: stop the daemon NAME. The pid file is trusted only if its pid is that
# program (a stale file may name a reused pid); otherwise the daemon is looked up by exact name.
stop_pid() {
  local name=$1 f=$2 pid=""
  if [ -s "$f" ]; then
    pid=$(cat "$f")
    [ -r "/proc/$pid/comm" ] && [ "$(cat "/proc/$pid/comm")" = "$name" ] || pid=""
  fi
  [ -n "$pid" ] || pid=$(pgrep -x "$name" | head -n1 || true)
  rm -f "$f"
  [ -n "$pid" ] || return 0
  kill "$pid" 2>/dev/null
  for _ in $(seq 1 60); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
  if kill -0 "$pid" 2>/dev/null; then echo "[devcluster] $name ($pid) did not exit, SIGKILL"; kill -9 "$pid"; fi
  echo "[devcluster] stopped $name ($pid)"
}

# Cancel jobs first so slurmd is not stopped under running steps (they would linger as orphans
# under proctrack/linuxproc).
if command -v scancel >/dev/null && scontrol ping >/dev/null 2>&1; then
  scancel --user=root 2>/dev/null || true
  for _ in $(seq 1 20); do [ -z "$(squeue -h 2>/dev/null)" ] && break; sleep 0.5; done
fi
stop_pid slurmd /run/slurmd.pid
for f in /run/slurmd-node*.pid; do [ -e "$f" ] && stop_pid slurmd "$f"; done
while pgrep -x slurmd >/dev/null; do stop_pid slurmd /nonexistent; done  # one without a pid file
stop_pid slurmctld /run/slurmctld.pid
stop_pid slurmdbd /run/slurmdbd.pid
if [ -x /etc/init.d/mariadb ] && mysqladmin ping >/dev/null 2>&1; then
  if [ "$PURGE" = 1 ]; then mysql -uroot -e 'DROP DATABASE IF EXISTS slurm_acct_db' && echo "[devcluster] dropped slurm_acct_db"; fi
  /etc/init.d/mariadb stop >/dev/null && echo "[devcluster] stopped mariadb"
elif [ "$PURGE" = 1 ] && [ -d /var/lib/mysql/slurm_acct_db ]; then
  /etc/init.d/mariadb start >/dev/null 2>&1 9>&- \
    && mysql -uroot -e 'DROP DATABASE IF EXISTS slurm_acct_db' && echo "[devcluster] dropped slurm_acct_db"
  /etc/init.d/mariadb stop >/dev/null 2>&1
fi
stop_pid munged /run/munge/munged.pid
if [ -d "$NET_RUN" ] || ip netns list 2>/dev/null | grep -q "^${NS_HEAD}\b"; then
  net_down && rm -rf "$NET_RUN"; echo "[devcluster] removed the multi-node namespaces, links, forwarders and hosts lines"
fi
if [ "$PURGE" = 1 ]; then
  rm -rf /var/spool/slurmctld/* /var/spool/slurmd/*
  echo "[devcluster] purged Slurm state (job ids restart at 1)"
fi
echo "[devcluster] STOPPED"
exit 0
