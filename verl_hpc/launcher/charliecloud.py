"""The command prefix and job set-up lines for ranks that run in a Charliecloud container.

Every rank runs `ch-run [--bind ...] --cd WORKDIR IMAGE -- python ...` under `srun --mpi=pmix`.
What differs from Apptainer, and why each line below exists:
- ch-run binds a host path only onto a directory that already exists in the image, and never
  creates one in a read-only image. For a directory image (a name in ch-image's storage or a
  path) the job first creates the missing mount points with a short writable `ch-run -w`; a
  SquashFS image (`.sqfs`/`.sqsh`) must have them built in (containers/README.md).
- Slurm's PMIx plugin keeps each step's directory under Slurm's TmpFS; when that is not /tmp
  (slurm.conf `TmpFS`), bind it through slurm.container.mounts (the dev cluster: /var/spool/slurmd).
- ch-run refuses to start without $USER, which batch environments do not always set.
- Open MPI's PMIx client inside the container would attach to the Slurm PMIx server's
  shared-memory data store in the server's directory on the host, which the container does not
  see; PMIX_MCA_gds=hash makes it fetch the same data over the server connection instead, and
  Open MPI's session directory goes to /tmp (bound) rather than a host-only path.
The host environment (SLURM_*, PMIX_*, MASTER_*) passes into the container unchanged, and
/tmp is the host's, so the ranks see the same job as they would outside.
"""
from __future__ import annotations

import shlex

SQUASHFS_SUFFIXES = (".sqfs", ".sqsh", ".squashfs")
ENV = {"PMIX_MCA_gds": "hash", "OMPI_MCA_orte_tmpdir_base": "/tmp"}


def mount_points(c, workdir: str) -> list[str]:
    """Host paths bound at the same place in the container: the working directory first."""
    points = [workdir]
    for m in c.mounts:
        src, _, dst = m.partition(":")
        points.append(dst or src)
    return list(dict.fromkeys(points))


def run_prefix(c, workdir: str) -> list[str]:
    """`ch-run ... IMAGE --`; the caller appends the command (python -m ...)."""
    binds = dict.fromkeys(f"--bind={m}" for m in [workdir, *c.mounts])
    return ["ch-run", *binds, f"--cd={workdir}", *c.extra_args, c.image, "--"]


def setup_lines(c, workdir: str) -> list[str]:
    """Shell lines for the batch script, run once before srun starts the ranks."""
    lines = ['export USER="${USER:-$(id -un)}"']
    lines += [f"export {k}={shlex.quote(v)}" for k, v in ENV.items()]
    if not c.image.endswith(SQUASHFS_SUFFIXES):
        # `ch-run -w` refuses images named from storage, so the directories are made from outside
        root = shlex.quote(c.image) if "/" in c.image else (
            '"${CH_IMAGE_STORAGE:-/var/tmp/$USER.ch}"/img/' + shlex.quote(c.image.replace(":", "+")))
        for p in mount_points(c, workdir):
            lines.append(f"mkdir -p {root}{shlex.quote(p)}")
    return lines
