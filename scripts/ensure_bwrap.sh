#!/usr/bin/env bash
# Make sure bubblewrap (`bwrap`) and the system Python are installed: the sandbox tests run its bwrap
# mode, and run payloads from an unprivileged uid with /usr/bin/python3 (the venv's Python may live
# under /root, which that uid cannot read); nothing in the unit tier skips. `make check` calls this
# (`make test` installs both with the dev cluster's packages, slurm/devcluster/start.sh). Idempotent:
# does nothing where both are there.
set -euo pipefail
command -v bwrap >/dev/null && [ -x /usr/bin/python3 ] && exit 0
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  echo "[ensure_bwrap] installing bubblewrap python3-minimal"
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -qq -o DPkg::Lock::Timeout=600 --no-install-recommends bubblewrap python3-minimal >/dev/null 2>&1 || {
    apt-get update -qq -o DPkg::Lock::Timeout=600
    apt-get install -y -qq -o DPkg::Lock::Timeout=600 --no-install-recommends bubblewrap python3-minimal >/dev/null
  }
else
  echo "[ensure_bwrap] bwrap or /usr/bin/python3 is missing: install the bubblewrap and python3-minimal" \
       "packages (as root), or the tests of tests/unit/rollout/test_sandbox*.py fail" >&2
  exit 1
fi
