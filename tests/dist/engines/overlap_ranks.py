"""Two gloo ranks (data parallel 2, the distributed optimizer): the Megatron engine trained with the
GPU defaults overlap_grad_reduce and overlap_param_gather on and off (tests/dist/engines/test_eng_overlap.py)."""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from eng_ranks import main  # noqa: E402


def run(args, workdir, out):
    import torch

    from verl_hpc.engines.megatron import MegatronEngine
    from verl_hpc.engines.megatron.kernels import KernelSwitches
    from verl_hpc.gpu_check import workload
    from verl_hpc.parallel import destroy_model_parallel, init_model_parallel

    mp = init_model_parallel(1, 1, seed=1)
    out["dp"] = mp.dp
    for overlap in (False, True):
        opts = workload.train_options(args["model"], "float32", use_distributed_optimizer=True)
        eng = MegatronEngine(dataclasses.replace(opts, kernels=KernelSwitches(
            overlap_grad_reduce=overlap, overlap_param_gather=overlap)))
        out[f"perf.{overlap}"] = [eng.shard_optimizer, eng.perf.overlap_grad_reduce, eng.perf.overlap_param_gather]
        for seed in (1, 2):
            m = eng.train_step(workload.batch(seed, rows=8), workload.loss_fn)
            out.setdefault(f"loss.{overlap}", []).append(m["loss"])
        # read right after the step: the overlapped gather has not run yet (what a reader must not see)
        stale = torch.cat([p.detach().reshape(-1) for p in eng._parameters()])
        params = torch.cat([p.detach().reshape(-1) for p in eng.parameters()])
        out[f"stale_differs.{overlap}"] = not torch.equal(stale, params)
        torch.save(params, Path(workdir) / f"params.{overlap}.rank{torch.distributed.get_rank()}.pt")
        del eng
    destroy_model_parallel()


if __name__ == "__main__":
    main(sys.argv[1], run=run)
