#!/usr/bin/env bash
# Make sure bubblewrap (`bwrap`) is installed: the sandbox tests run its bwrap mode and nothing in
# the unit tier skips. `make check` calls this (`make test` installs it with the dev cluster's
# packages, slurm/devcluster/start.sh). Idempotent: does nothing where bwrap is on PATH.
set -euo pipefail
command -v bwrap >/dev/null && exit 0
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  echo "[ensure_bwrap] installing bubblewrap"
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -qq -o DPkg::Lock::Timeout=600 --no-install-recommends bubblewrap >/dev/null 2>&1 || {
    apt-get update -qq -o DPkg::Lock::Timeout=600
    apt-get install -y -qq -o DPkg::Lock::Timeout=600 --no-install-recommends bubblewrap >/dev/null
  }
else
  echo "[ensure_bwrap] bwrap is not installed: install the bubblewrap package (as root), or the" \
       "bwrap tests of tests/unit/rollout/test_sandbox.py fail" >&2
  exit 1
fi
