#!/usr/bin/env bash
# Run a command on node K of a multi-node dev cluster (start.sh --nodes N): inside that node's
# network namespace and with its host name, as its slurmd and ranks see them.
#   sudo bash slurm/devcluster/on_node.sh 2 hostname
#   sudo bash slurm/devcluster/on_node.sh 1 srun -N2 --ntasks-per-node=1 hostname
set -euo pipefail
k=${1:?usage: on_node.sh K COMMAND...}; shift
[ $# -gt 0 ] || { echo "usage: on_node.sh K COMMAND..." >&2; exit 2; }
pid=$(cat "/run/slurmd-node$k.pid" 2>/dev/null) || { echo "node$k: no slurmd pid file (is the cluster started with --nodes >= $k?)" >&2; exit 1; }
exec nsenter --net="/run/netns/vhpc-node$k" --uts="/proc/$pid/ns/uts" -- "$@"
