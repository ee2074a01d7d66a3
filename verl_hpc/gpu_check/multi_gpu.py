"""The kit's two-rank check: tensor parallel 2, then data parallel 2 with the distributed optimizer,
on NCCL across two GPUs of this node (gloo on CPU under --cpu-rehearsal).

    run_two_ranks(out, model_path, rehearsal)   # parent: start 2 ranks, wait, return rank 0's result
    python -m verl_hpc.gpu_check.multi_gpu WORKDIR   # one rank (torchrun's variables in its env)

The kit's own process holds a world of one rank, so the two ranks are fresh processes, started with
torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT) the way the project's
runtime reads them; each binds the GPU of its local rank. What they run:
- TP 2: the frozen engine's log-probs of the kit's batch (the parent compares them with
  transformers), and one train step at TP 2 (finite loss, parameters moved);
- DP 2: a train step with `use_distributed_optimizer` (the engine shards only at dp > 1, which a
  one-GPU kit cannot show); the updated parameters must be equal on both ranks.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

from verl_hpc.runtime.local_ranks import host_store, torchrun_env, wait_all

WORLD = 2
TIMEOUT_S = 420


def run_two_ranks(out: Path, model_path: str, rehearsal: bool, dtype: str, timeout_s: float = TIMEOUT_S,
                  module: str = "verl_hpc.gpu_check.multi_gpu", name: str = "two_ranks") -> dict:
    """Start the ranks, wait (one deadline for both; a late or failed rank gets both killed, our
    own children by handle) and return rank 0's result; raise with the logs' tails on failure.
    `module`: the ranks' program (its main takes the work folder; cp_check.py has its own)."""
    work = Path(out) / name
    work.mkdir(parents=True, exist_ok=True)
    (work / "args.json").write_text(json.dumps({"model_path": model_path, "rehearsal": rehearsal, "dtype": dtype}))
    store, procs = host_store(), []  # held until the ranks end
    root = Path(__file__).resolve().parents[2]
    for rank in range(WORLD):
        env = torchrun_env(rank, WORLD, store.port,
                           PYTHONPATH=os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])))
        if rehearsal:
            env["OMP_NUM_THREADS"] = "1"  # two CPU ranks share the machine's cores
        with open(work / f"rank{rank}.log", "w") as log:
            procs.append(subprocess.Popen([sys.executable, "-m", module, str(work)],
                                          cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT))
    failed = wait_all(procs, timeout_s)
    if failed:
        tails = "\n".join(f"--- rank {r} (rc {p.returncode}) ---\n" + (work / f"rank{r}.log").read_text()[-1500:]
                          for r, p in enumerate(procs))
        raise RuntimeError(f"{name} check failed (logs in {work}):\n{tails}")
    return json.loads((work / "rank0.json").read_text())


def _sliced_sync(eng, rank: int) -> dict:
    """The sliced weight sync of the trained TP 2 engine (one all_to_all per bucket: NCCL on GPUs)
    into inference TP 2 and TP 1, with delta: the first sync dense and bitwise the export's
    slices, the second (nothing moved) sends nothing and checks every slice's checksum."""
    from verl_hpc.resharding import SliceSink, WeightSync

    want = {n: t.detach().clone() for n, t in eng.export_hf_weights()}
    out = {}
    for itp in (2, 1):
        sink, syncer = SliceSink(rank % itp, itp), WeightSync(bucket_mb=1, mode="sliced", delta=True)
        first = syncer(eng, sink)
        second = syncer(eng, sink)
        out[f"inference_tp{itp}"] = {"mismatches": sink.mismatches(want)[:5], "bytes": first["sync/bytes"],
                                     "delta_bytes": second["sync/bytes"]}
    return out


def _rank_main(work: Path) -> None:
    import torch
    import torch.distributed as dist

    from verl_hpc.engines.megatron import MegatronEngine, default_options
    from verl_hpc.gpu_check.workload import batch as _batch, loss_fn as _loss_fn, train_options
    from verl_hpc.parallel import destroy_model_parallel, init_model_parallel
    from verl_hpc.runtime.bootstrap import bootstrap, shutdown

    args = json.loads((work / "args.json").read_text())
    rehearsal, path, dtype = args["rehearsal"], args["model_path"], args["dtype"]
    ctx = bootstrap(backend="gloo" if rehearsal else "nccl", timeout_s=300)
    rank = dist.get_rank()
    result = {"device": str(ctx.device), "backend": ctx.backend}

    # --- tensor parallel 2
    mp = init_model_parallel(2, 1, seed=1234, timeout_minutes=5)
    assert (mp.tp, mp.dp) == (2, 1), (mp.tp, mp.dp)
    frozen = MegatronEngine(default_options(model_path=path, trainable=False, dtype=dtype, micro_batch_size=2))
    result["tp2_log_probs"] = frozen.forward(_batch(), ("log_probs",))["log_probs"].float().cpu().tolist()
    del frozen
    eng = MegatronEngine(train_options(path, dtype, use_distributed_optimizer=False))
    before = [p.detach().clone() for p in eng._parameters()]
    m = eng.train_step(_batch(1), _loss_fn)
    assert m["nonfinite"] == 0.0 and math.isfinite(m["loss"]), m
    moved = sum(not torch.equal(a, b) for a, b in zip(before, eng._parameters()))
    assert moved > 0, "TP 2: no parameter changed"
    result["tp2_step"] = {"loss": m["loss"], "grad_norm": m["grad_norm"], "moved": moved}
    result["sliced_sync"] = _sliced_sync(eng, rank)
    del eng, before
    destroy_model_parallel()

    # --- data parallel 2 with the distributed optimizer
    mp = init_model_parallel(1, 1, seed=1234, timeout_minutes=5)
    assert (mp.tp, mp.dp) == (1, 2), (mp.tp, mp.dp)
    eng = MegatronEngine(train_options(path, dtype, use_distributed_optimizer=True))
    assert eng.shard_optimizer, "the engine did not shard the optimizer at dp 2"
    inner = type(eng.optimizer.chained_optimizers[0])
    m = eng.train_step(_batch(1), _loss_fn)
    assert m["nonfinite"] == 0.0 and math.isfinite(m["loss"]), m
    # parameters(): with overlap_param_gather (auto-on here) the step leaves the gather to the next
    # forward; read before it, the other rank's shard would be stale and the ranks would "differ"
    flat = torch.cat([p.detach().float().reshape(-1) for p in eng.parameters()])
    spread = flat.clone()
    dist.all_reduce(spread, op=dist.ReduceOp.MAX)
    lowest = flat.clone()
    dist.all_reduce(lowest, op=dist.ReduceOp.MIN)
    differ = float((spread - lowest).abs().max())
    assert differ == 0.0, f"DP 2: parameters differ between the ranks after the step (max {differ:.3g})"
    result["dp2_step"] = {"loss": m["loss"], "optimizer": f"{inner.__module__}.{inner.__name__}"}
    del eng
    destroy_model_parallel()
    (work / f"rank{rank}.json").write_text(json.dumps(result))
    shutdown()


if __name__ == "__main__":
    _rank_main(Path(sys.argv[1]))
