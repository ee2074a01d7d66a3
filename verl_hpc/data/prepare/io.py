"""Writing prepared rows: parquet, atomically (a crashed run never leaves half a file behind)."""
from __future__ import annotations

import os
from typing import Dict, List

import pyarrow as pa
import pyarrow.parquet as pq


def write_parquet(rows: List[Dict], path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    pq.write_table(pa.Table.from_pylist(rows), tmp)
    os.replace(tmp, path)
