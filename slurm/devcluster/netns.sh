# Sourced by start.sh / stop.sh (not run on its own): the network of a multi-node dev cluster.
#
# Every node is a network namespace "vhpc-nodeK" with its own UTS namespace (hostname nodeK,
# given to slurmd when it starts) and one veth link "vheth0" (address $SUBNET.(10+K)/24) into
# the namespace "vhpc-head", which holds the bridge vhbr0 ($SUBNET.1) and runs slurmctld. The
# private addresses exist ONLY inside these namespaces: the machine's own network namespace gets
# no address, route or link, so no packet of the cluster can leave the machine or reach its LAN.
# Deleting the namespaces deletes every link and address with them.
#
# The machine's own namespace still needs the controller (sbatch, sinfo, submitit and the tests
# run there) and slurmctld needs slurmdbd (which stays beside MariaDB): socat forwarders join the
# loopbacks through Unix sockets under $NET_RUN, which cross network namespaces because they
# live in the shared filesystem:
#   host 127.0.0.1:6817 -> ctld.sock -> head 127.0.0.1:6817 (slurmctld)
#   head $SUBNET.1:6819 + 127.0.0.1:6819 -> dbd.sock -> host 127.0.0.1:6819 (slurmdbd)
#   nodeK 127.0.0.1:6817/6819 -> head $SUBNET.1:6817/6819
# so SlurmctldHost/AccountingStorageHost = 127.0.0.1 hold in every namespace. munge is a Unix
# socket too and is shared as is.
#
# Link shaping: tbf on both ends of every node's veth gives the inter-node links a bandwidth
# ($LINK_RATE); ranks of one node talk over that namespace's loopback, unshaped. Latency needs
# the netem qdisc, which many container kernels lack: then it is skipped with a log line.

NS_HEAD=vhpc-head
NS_PREFIX=vhpc-node
NET_RUN=/run/verl_hpc/net
HOSTS_TAG="# verl_hpc devcluster"

node_ns() { echo "${NS_PREFIX}$1"; }
node_addr() { echo "${SUBNET}.$((10 + $1))"; }

# socat_fwd TAG NETNS|"" ARGS...: one forwarder, pid in $NET_RUN/TAG.pid, started only if absent
socat_fwd() {
  local tag=$1 ns=$2; shift 2
  local pf="$NET_RUN/$tag.pid" pid
  if [ -s "$pf" ]; then
    pid=$(cat "$pf")
    [ -r "/proc/$pid/comm" ] && [ "$(cat "/proc/$pid/comm")" = socat ] && return 0
  fi
  local run=(); [ -n "$ns" ] && run=(nsenter --net="/run/netns/$ns")
  # the pid file gets the socat's own pid: bash writes $$, then execs ip (which execs socat)
  # (the subshell drops the lock's descriptor before anything else, or the lock outlives start.sh)
  (exec 9>&- </dev/null >>"$NET_RUN/$tag.log" 2>&1
   exec setsid bash -c 'echo $$ > "$0"; exec "$@"' "$pf" ${run[@]+"${run[@]}"} socat "$@") &
}

# net_up N: namespaces, bridge, links, addresses, shaping, forwarders, /etc/hosts (idempotent)
net_up() {
  local n=$1 k ns
  install -d -m 0755 "$NET_RUN"
  ip netns list | grep -qw "$NS_HEAD" || ip netns add "$NS_HEAD"
  ip -n "$NS_HEAD" link set lo up
  ip -n "$NS_HEAD" link show vhbr0 >/dev/null 2>&1 || ip -n "$NS_HEAD" link add vhbr0 type bridge
  ip -n "$NS_HEAD" addr replace "${SUBNET}.1/24" dev vhbr0
  ip -n "$NS_HEAD" link set vhbr0 up
  for ((k = 1; k <= n; k++)); do
    ns=$(node_ns "$k")
    ip netns list | grep -qw "$ns" || ip netns add "$ns"
    ip -n "$ns" link set lo up
    if ! ip -n "$ns" link show vheth0 >/dev/null 2>&1; then
      ip -n "$NS_HEAD" link add "vhn$k" type veth peer name vheth0 netns "$ns"
    fi
    ip -n "$NS_HEAD" link set "vhn$k" master vhbr0 up
    ip -n "$ns" addr replace "$(node_addr "$k")/24" dev vheth0
    ip -n "$ns" link set vheth0 up
    shape_link "$ns" vheth0
    shape_link "$NS_HEAD" "vhn$k"
    socat_fwd "node$k-ctld" "$ns" TCP-LISTEN:6817,bind=127.0.0.1,reuseaddr,fork "TCP:${SUBNET}.1:6817"
    socat_fwd "node$k-dbd" "$ns" TCP-LISTEN:6819,bind=127.0.0.1,reuseaddr,fork "TCP:${SUBNET}.1:6819"
  done
  socat_fwd head-ctld "$NS_HEAD" "UNIX-LISTEN:$NET_RUN/ctld.sock,fork,unlink-early" TCP:127.0.0.1:6817
  socat_fwd host-ctld "" TCP-LISTEN:6817,bind=127.0.0.1,reuseaddr,fork "UNIX-CONNECT:$NET_RUN/ctld.sock"
  socat_fwd host-dbd "" "UNIX-LISTEN:$NET_RUN/dbd.sock,fork,unlink-early" TCP:127.0.0.1:6819
  socat_fwd head-dbd "$NS_HEAD" TCP-LISTEN:6819,reuseaddr,fork "UNIX-CONNECT:$NET_RUN/dbd.sock"
  hosts_set "$n"
}

# shape_link NETNS DEV: bandwidth (tbf) and, where the kernel has netem, latency
shape_link() {
  [ "$LINK_RATE" = 0 ] && { ip -n "$1" link show "$2" >/dev/null && tc -n "$1" qdisc del dev "$2" root 2>/dev/null; return 0; }
  if [ "$LINK_DELAY_US" != 0 ] && tc -n "$1" qdisc replace dev "$2" root netem delay "${LINK_DELAY_US}us" rate "$LINK_RATE" 2>/dev/null; then
    return 0
  fi
  # burst: at least rate/HZ; 256 KB suits 1-10 Gbit/s. latency bounds the queue.
  tc -n "$1" qdisc replace dev "$2" root tbf rate "$LINK_RATE" burst 256kb latency 50ms
}

hosts_set() { # replace our tagged lines in /etc/hosts (in place: /etc/hosts may be a bind mount)
  local n=$1 k lines=""
  for ((k = 1; k <= n; k++)); do lines+="$(node_addr "$k") node$k $HOSTS_TAG"$'\n'; done
  local cur; cur=$(grep -v -F "$HOSTS_TAG" /etc/hosts || true)
  printf '%s\n%s' "$cur" "$lines" > /etc/hosts
}

hosts_clear() {
  grep -q -F "$HOSTS_TAG" /etc/hosts 2>/dev/null || return 0
  local cur; cur=$(grep -v -F "$HOSTS_TAG" /etc/hosts || true)
  printf '%s\n' "$cur" > /etc/hosts
}

# net_down: stop our forwarders, delete our namespaces (with their links), drop the hosts lines
net_down() {
  local pf pid ns
  for pf in "$NET_RUN"/*.pid; do
    [ -e "$pf" ] || continue
    pid=$(cat "$pf")
    if [ -r "/proc/$pid/comm" ] && [ "$(cat "/proc/$pid/comm")" = socat ]; then kill "$pid" 2>/dev/null; fi
    rm -f "$pf"
  done
  for ns in $(ip netns list | awk '{print $1}' | grep -E "^(${NS_HEAD}|${NS_PREFIX}[0-9]+)$" || true); do
    # a process left in the namespace (a stray task) would keep it alive: say so
    pids=$(ip netns pids "$ns" 2>/dev/null | tr '\n' ' ')
    [ -n "$pids" ] && echo "[devcluster] killing processes left in $ns: $pids" && kill -9 $pids 2>/dev/null
    ip netns del "$ns"
  done
  rm -f "$NET_RUN"/*.sock
  hosts_clear
}

# node_slurmd_up K: slurmd of node K in its network namespace and a fresh UTS namespace
node_slurmd_up() {
  local k=$1 pf="/run/slurmd-node$1.pid" pid
  if [ -s "$pf" ]; then
    pid=$(cat "$pf")
    [ -r "/proc/$pid/comm" ] && [ "$(cat "/proc/$pid/comm")" = slurmd ] && return 0
    rm -f "$pf"
  fi
  install -d "/var/spool/slurmd/node$k" && install -d -m 1777 "/var/spool/slurmd/node$k/tmp"
  spawn nsenter --net=/run/netns/"$(node_ns "$k")" unshare --uts sh -c "hostname node$k && exec slurmd"
}
