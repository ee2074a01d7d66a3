"""Rank side of test_ckpt_moe_layouts.py: a mixture-of-experts actor's state through HDF5
checkpoints across expert-parallel sizes, on 2 gloo ranks:

    ep2 : build, one SFT step (model and Adam states non-trivial), save A
    ep1 : load A (DP 2, every expert on both ranks), save B
    ep2 : load B, save C; full-vocabulary logits of fixed ids after each load

    python ckpt_moe_ranks.py WORKDIR     (started by tests/rank_launcher.py)
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "engines"))


def main(workdir: str) -> None:
    import torch
    import torch.distributed as dist

    from eng_ranks import _full_logits
    from verl_hpc.checkpoint import open_checkpoint, save_checkpoint
    from verl_hpc.checkpoint.checkpointer import _prefixed
    from verl_hpc.config.schema import OptimConfig
    from verl_hpc.engines.batch import pack_sequences
    from verl_hpc.engines.megatron import MegatronEngine, default_options
    from verl_hpc.parallel import destroy_model_parallel, init_model_parallel
    from verl_hpc.runtime import bootstrap, collectives
    from verl_hpc.trainer.programs.sft import nll_loss

    args = json.loads((Path(workdir) / "args.json").read_text())
    ctx = bootstrap(backend="gloo", num_threads=1, timeout_s=180)
    ids = torch.tensor(args["ids"])
    g = torch.Generator().manual_seed(3)
    batch = pack_sequences([torch.randint(5, 480, (6,), generator=g).tolist() for _ in range(8)],
                           [torch.randint(5, 480, (5,), generator=g).tolist() for _ in range(8)])
    out = {}
    for step in args["steps"]:
        mp = init_model_parallel(1, 1, ep=step["ep"], seed=1)
        eng = MegatronEngine(default_options(model_path=args["model"], optim=OptimConfig(lr=1e-2),
                                             micro_batch_size=2, total_steps=10, use_distributed_optimizer=True))
        if step.get("load"):
            with open_checkpoint(step["load"]) as r:
                eng.load_state(lambda slabs: r.load_into(_prefixed("actor", slabs)),
                               r.metadata["trainer_state"]["engines"]["actor"])
        if step.get("train"):
            collectives.reset()
            metrics = eng.train_step(batch, nll_loss, ("log_probs",))
            out[f"{step['name']}.metrics"] = {k: v for k, v in metrics.items() if "moe" in k or k == "loss"}
            out[f"{step['name']}.alltoall_train"] = _alltoall_bytes(collectives.counts())
            out["train_tokens_here"] = int(batch["input_ids"].numel()) // dist.get_world_size()
        collectives.reset()
        logits = _full_logits(eng, ids)
        out[f"{step['name']}.alltoall_forward"] = _alltoall_bytes(collectives.counts())
        if ctx.rank == 0:
            torch.save(logits, Path(workdir) / f"{step['name']}.logits.pt")
        out[f"{step['name']}.ep_rank"] = mp.ep_rank
        st = eng.state()
        save_checkpoint(step["save"], 1, _prefixed("actor", st.tensors),
                        metadata={"trainer_state": {"engines": {"actor": st.meta}}},
                        layout={"tp": 1, "pp": 1, "ep": step["ep"]})
        del eng
        destroy_model_parallel()
        dist.barrier()
    (Path(workdir) / f"rank{ctx.rank}.json").write_text(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()


def _alltoall_bytes(counts) -> int:
    """Payload bytes this rank handed to all_to_all_single on the expert-parallel group."""
    return sum(b for (op, group), (_, b) in counts.items() if op == "all_to_all_single" and group == "ep")


if __name__ == "__main__":
    main(sys.argv[1])
