"""Spawn gloo ranks that run the rollout scenario under the project's runtime.

`launch(n, args, workdir)` starts n copies of this file with torchrun-style variables (RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT), so `verl_hpc.runtime.bootstrap()` brings each rank up
as in a real job. Each rank writes rank{r}.json; a failing rank fails the launch with every
rank's log tail.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "tests"))  # hf_reference, in the rank processes too


def launch(world_size: int, args: dict, workdir: Path, timeout: float = 420):
    """(port, per-rank results): the port names the job's CPU shared-memory segments."""
    from rank_launcher import launch_ranks  # tests/: on sys.path under pytest, not in the ranks

    # fresh interpreters: the test checks that vLLM's shared-memory segments go when the ranks exit
    return launch_ranks(__file__, world_size, args, workdir, timeout=timeout, what="rollout scenario",
                        log_level="INFO", with_port=True, fresh=True)


# ----------------------------------------------------------------------------- rank side


def _as_dict(result):
    return dict(prompt_index=result.prompt_index, sample_index=result.sample_index,
                response_ids=result.response_ids, logprobs=result.logprobs,
                finish_reason=result.finish_reason)


def _collective_ok():
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        return False
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item() == dist.get_world_size()


def _scenario(workdir: Path) -> None:
    from hf_reference import perturbed_state
    from verl_hpc.rollout.sampling import default_spec
    from verl_hpc.rollout.vllm.compat import job_token, mapped_shm_paths
    from verl_hpc.rollout.vllm.engine import VLLMRollout
    from verl_hpc.rollout.engine_config import default_engine_args
    from verl_hpc.runtime import bootstrap, shutdown

    args = json.loads((workdir / "args.json").read_text())
    ctx = bootstrap(seed=3)
    greedy = default_spec(temperature=0, max_tokens=args["max_new"])
    sampled = default_spec(n=2, temperature=0.8, top_k=20, max_tokens=args["max_new"], seed=9)
    new_state = perturbed_state(args["model"])
    out = {"rank": ctx.rank}
    for tp in (2, 1):
        engine = VLLMRollout(args["model"], tp=tp, ctx=ctx,
                             **default_engine_args("vllm", max_prompt_length=args["max_prompt"],
                                                   max_response_length=args["max_new"]))
        if tp == 2:
            # the segments as mapped (vLLM may unlink a segment once every rank has mapped it:
            # /proc/*/maps still names it, with " (deleted)")
            out["shm"] = sorted({Path(p).name for p in mapped_shm_paths() if "cpushm" in p})
            out["token"] = job_token()
            # vLLM uses its shared-memory communicator only where its CPU kernels carry the op
            # (not in every build / CPU variant); otherwise TP runs over torch.distributed
            import torch
            out["shm_op"] = hasattr(torch.ops._C, "init_shm_manager")
        out[f"tp{tp}"] = _as_dict(engine.generate(args["prompts"], greedy))
        out[f"tp{tp}_sampled"] = _as_dict(engine.generate(args["prompts"], sampled))
        out[f"tp{tp}_load"] = engine.load_weights(iter(new_state.items()))
        out[f"tp{tp}_updated"] = _as_dict(engine.generate(args["prompts"], greedy))
        engine.close()
        out[f"tp{tp}_dist_after_close"] = _collective_ok()
    (workdir / f"rank{ctx.rank}.json").write_text(json.dumps(out))
    shutdown()


if __name__ == "__main__":
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    _scenario(Path(sys.argv[1]))
