"""Writing prepared rows: parquet, atomically (a crashed run never leaves half a file behind)."""
from __future__ import annotations

import os
from typing import Dict, List

import pyarrow as pa
import pyarrow.parquet as pq

from verl_hpc.config.errors import ConfigError


def write_parquet(rows: List[Dict], path: str) -> None:
    """`rows` to `path`; an output path that cannot be written (a file where a folder should be,
    no permission, a full disk) is a ConfigError naming it: the path is the command's argument."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        pq.write_table(pa.Table.from_pylist(rows), tmp)
        os.replace(tmp, path)
    except OSError as e:
        if os.path.isfile(tmp):
            os.remove(tmp)
        raise ConfigError(f"cannot write '{path}': {e.strerror or e}; valid: a file path whose folder can be "
                          "created and written") from None
