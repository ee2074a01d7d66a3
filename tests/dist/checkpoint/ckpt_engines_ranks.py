"""Rank side of test_ckpt_cross_engine.py: one checkpoint carried across the two engines and three
layouts on the same 2 gloo ranks, one phase after the other:

    megatron_tp2  Megatron TP2: update 1 -> save M1; update 2 -> weights (the run as it would go on)
    fsdp          FSDP over 2 ranks: load M1 -> save F0 at once; update 2 -> weights; save F1;
                  update 3 -> weights. A fresh engine loads S1 (written by one rank before the
                  launch) -> saves S1r at once.
    megatron_pp2  Megatron PP2: load F1 -> save M2 at once; update 3 -> weights

Rank 0 writes the HF-named weights after each update as `<phase>.step<k>.pt`; every rank writes
rank{r}.json with the engines' meta and the LR each update used. Engines are built, updated,
saved and resumed by tests/engine_states.py, as on the test's one-rank side.

    python ckpt_engines_ranks.py WORKDIR     (started by tests/rank_launcher.py)
"""
from __future__ import annotations

import gc
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))  # tests/: engine_states


def main(workdir: str) -> None:
    import torch
    import torch.distributed as dist

    from engine_states import engine, load, make_batch, save, update, weights
    from verl_hpc.parallel import destroy_model_parallel, init_model_parallel
    from verl_hpc.runtime import bootstrap

    work = Path(workdir)
    args = json.loads((work / "args.json").read_text())
    ctx = bootstrap(backend="gloo", num_threads=1, timeout_s=180)
    model, ck = args["model"], {k: Path(v) for k, v in args["ckpt"].items()}
    batches = [make_batch(s) for s in args["batch_seeds"]]
    rec: dict = {"rank": ctx.rank, "meta": {}, "lr": {}, "seconds": {}}
    t0 = time.time()

    def lap(phase):
        nonlocal t0
        rec["seconds"][phase], t0 = round(time.time() - t0, 2), time.time()

    def keep(name, w):
        if ctx.rank == 0:
            torch.save(w, work / f"{name}.pt")

    # --- Megatron TP2
    init_model_parallel(2, 1, seed=1)
    eng = engine("megatron", model)
    rec["lr"]["megatron_tp2.1"] = update(eng, batches[0])["actor/lr"]
    rec["meta"]["M1"] = save(eng, ck["M1"], 1, {"tp": 2, "pp": 1})
    rec["lr"]["megatron_tp2.2"] = update(eng, batches[1])["actor/lr"]
    keep("megatron_tp2.step2", weights(eng))
    del eng
    destroy_model_parallel()
    gc.collect()
    dist.barrier()
    lap("megatron_tp2")

    # --- FSDP on the same 2 ranks (no Megatron parallel state)
    eng = engine("fsdp", model)
    load(eng, ck["M1"] / "step_000001")
    rec["lr"]["fsdp.loaded"] = eng.lr
    rec["meta"]["F0"] = save(eng, ck["F0"], 1, {"fsdp": 2})
    rec["lr"]["fsdp.2"] = update(eng, batches[1])["actor/lr"]
    keep("fsdp.step2", weights(eng))
    rec["meta"]["F1"] = save(eng, ck["F1"], 2, {"fsdp": 2})
    rec["lr"]["fsdp.3"] = update(eng, batches[2])["actor/lr"]
    keep("fsdp.step3", weights(eng))
    del eng
    eng = engine("fsdp", model)  # a checkpoint one rank wrote, at 2 ranks
    load(eng, ck["S1"])
    rec["meta"]["S1r"] = save(eng, ck["S1r"], 1, {"fsdp": 2})
    del eng
    gc.collect()
    dist.barrier()
    lap("fsdp")

    # --- Megatron PP2
    init_model_parallel(1, 2, seed=1)
    eng = engine("megatron", model)
    load(eng, ck["F1"] / "step_000002")
    rec["lr"]["megatron_pp2.loaded"] = eng.lr
    rec["meta"]["M2"] = save(eng, ck["M2"], 2, {"tp": 1, "pp": 2})
    rec["lr"]["megatron_pp2.3"] = update(eng, batches[2])["actor/lr"]
    keep("megatron_pp2.step3", weights(eng))
    del eng
    destroy_model_parallel()
    lap("megatron_pp2")
    (work / f"rank{ctx.rank}.json").write_text(json.dumps(rec))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
