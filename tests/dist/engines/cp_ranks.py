"""Ranks of tests/dist/engines/test_eng_cp_gather.py: Megatron's context-parallel group on 2 gloo
ranks (tp 1, cp 2, dp 1) and the split / gather of engines/megatron/context_parallel.py through it.
Each rank splits the same [B, S] batch, gathers its share back, and backpropagates a weighted sum
of the gathered result; it writes what it saw to rank{r}.json."""
from __future__ import annotations

import json
import sys
from pathlib import Path


def main(workdir: str) -> None:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from verl_hpc.engines.megatron import context_parallel as cpl
    from verl_hpc.parallel import destroy_model_parallel, init_model_parallel
    from verl_hpc.runtime import bootstrap

    args = json.loads((Path(workdir) / "args.json").read_text())
    ctx = bootstrap(backend="gloo", num_threads=1, timeout_s=120)
    init_model_parallel(1, 1, cp=args["cp"], seed=1)
    group = ps.get_context_parallel_group()
    b, s = args["batch"], args["seq"]
    x = torch.arange(b * s, dtype=torch.float64).view(b, s) * 0.5 + 1.0  # the same on every rank
    weights = torch.linspace(-1.0, 1.0, b * s, dtype=torch.float64).view(b, s)
    mine = cpl.split_for_rank({"x": x}, group)["x"].clone().requires_grad_(True)
    full = cpl.gather_sequence(mine, group)
    (full * weights).sum().backward()
    out = {"rank": ctx.rank, "cp_rank": ps.get_context_parallel_rank(), "cp": ps.get_context_parallel_world_size(),
           "dp": ps.get_data_parallel_world_size(),
           "dp_cp": ps.get_data_parallel_world_size(with_context_parallel=True),
           "local": mine.detach().tolist(), "gathered_equal": bool(torch.equal(full.detach(), x)),
           "grad": mine.grad.tolist(),
           "want_grad": weights.index_select(1, cpl.token_index(s, args["cp"], ps.get_context_parallel_rank())).tolist()}
    (Path(workdir) / f"rank{ctx.rank}.json").write_text(json.dumps(out))
    dist.barrier()
    destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
