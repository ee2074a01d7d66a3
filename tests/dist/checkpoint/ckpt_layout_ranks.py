"""Rank side of test_ckpt_trainer_layouts.py: load a trainer checkpoint's `actor/` state into a
Megatron engine at each layout of args["layouts"] in turn, record full-vocabulary logits of fixed
token ids, and optionally save the loaded state again (at that layout) as a new checkpoint.

    python ckpt_layout_ranks.py WORKDIR     (started by tests/rank_launcher.py)
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
    from verl_hpc.engines.megatron import default_options, MegatronEngine
    from verl_hpc.parallel import destroy_model_parallel, init_model_parallel
    from verl_hpc.runtime import bootstrap

    args = json.loads((Path(workdir) / "args.json").read_text())
    ctx = bootstrap(backend="gloo", num_threads=1, timeout_s=180)
    ids = torch.tensor(args["ids"])
    for lay in args["layouts"]:
        init_model_parallel(lay["tp"], lay["pp"], seed=1)
        eng = MegatronEngine(default_options(model_path=args["model"], optim=OptimConfig(lr=1e-3),
                                             micro_batch_size=4, total_steps=10, use_distributed_optimizer=True))
        for i, src in enumerate(lay["load"]):
            with open_checkpoint(src) as r:
                eng.load_state(lambda slabs: r.load_into(_prefixed("actor", slabs)),
                               r.metadata["trainer_state"]["engines"]["actor"])
            logits = _full_logits(eng, ids)
            if ctx.rank == 0:
                torch.save(logits, Path(workdir) / f"{lay['name']}.{i}.logits.pt")
        if lay.get("save"):
            st = eng.state()
            save_checkpoint(lay["save"], 1, _prefixed("actor", st.tensors),
                            metadata={"trainer_state": {"engines": {"actor": st.meta}}},
                            layout={"tp": lay["tp"], "pp": lay["pp"]})
        del eng
        destroy_model_parallel()
        dist.barrier()
    (Path(workdir) / f"rank{ctx.rank}.json").write_text(json.dumps({"ok": True}))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
