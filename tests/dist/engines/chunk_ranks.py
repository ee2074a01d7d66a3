"""Ranks of tests/dist/engines/test_chunked_logits_tp.py: both engines on 2 gloo ranks, each case
twice, with the output layer in chunks of 5 tokens and with the whole logits
(model.logits_chunk_tokens = 0): the forward's three outputs, then one actor update. Global rank 0
saves `<case>.chunk<k>.pt` ({"out": forward outputs, "weights": the exported weights}); every rank
reports the update's metrics (rank{r}.json, eng_ranks.main).

    megatron.tp2.llama     TP 2 (the padded vocabulary's rows on rank 1), temperature 0.7
    megatron.tp2.qwen2     TP 2, tied embeddings, packed rows (share_prompts = on), temperature 1
    fsdp.dp2.qwen2         FSDP over 2 ranks, tied, packed rows, temperature 0.7
    fsdp.sp2.llama         Ulysses sp 2 (each rank scores its slice of the tokens), temperature 0.7
"""
from __future__ import annotations

import sys
from pathlib import Path

from eng_ranks import _export, _save, main

CASES = {"megatron.tp2.llama": dict(engine="megatron", model="llama", temperature=0.7, share="off"),
         "megatron.tp2.qwen2": dict(engine="megatron", model="qwen2", temperature=1.0, share="on"),
         "fsdp.dp2.qwen2": dict(engine="fsdp", model="qwen2", temperature=0.7, share="on"),
         "fsdp.sp2.llama": dict(engine="fsdp", model="llama", temperature=0.7, share="off", sp=2)}
CHUNKS = (5, 0)


def launch(args: dict, workdir: Path, timeout: float = 300):
    from rank_launcher import launch_ranks  # tests/: on sys.path under pytest, not in the ranks

    return launch_ranks(__file__, 2, args, workdir, timeout=timeout, what="chunked output layer scenario")


def _engine(args, case: dict, chunk: int):
    from verl_hpc.config.schema import OptimConfig
    from verl_hpc.config.sections.fsdp import FsdpConfig
    from verl_hpc.engines.options import default_options

    o = default_options(args["models"][case["model"]], engine=case["engine"], optim=OptimConfig(**args["optim"]),
                        temperature=case["temperature"], share_prompts=case["share"], total_steps=4,
                        micro_batch_size=8 if case["share"] == "on" else 2, logits_chunk_tokens=chunk,
                        fsdp=FsdpConfig(sp=case.get("sp", 1)))
    if case["engine"] == "fsdp":
        from verl_hpc.engines.fsdp import FsdpEngine

        return FsdpEngine(o)
    from verl_hpc.engines.megatron import MegatronEngine

    return MegatronEngine(o)


def scenario(args, workdir, out: dict) -> None:
    import torch

    from verl_hpc.algorithms import PolicyObjective
    from verl_hpc.config.schema import ActorConfig
    from verl_hpc.engines.roles import Actor
    from verl_hpc.parallel import destroy_model_parallel, init_model_parallel

    data = torch.load(Path(workdir) / "batch.pt")
    acfg = ActorConfig(**args["actor"])
    checks = out["checks"] = {}
    for name, case in CASES.items():
        batch = data["grouped" if case["share"] == "on" else "plain"]
        for chunk in CHUNKS:
            print(f"check {name} chunk {chunk}", flush=True)
            if case["engine"] == "megatron":
                init_model_parallel(2, 1, seed=1)
            eng = _engine(args, case, chunk)
            outputs = eng.forward(batch, ("log_probs", "entropy", "sum_pi_squared"))
            metrics = Actor(eng, acfg).update(batch, PolicyObjective.from_config(acfg))
            _save(workdir, f"{name}.chunk{chunk}", {"out": outputs, "weights": _export(eng)})
            checks[f"{name}.chunk{chunk}"] = {"metrics": metrics}
            del eng
            if case["engine"] == "megatron":
                destroy_model_parallel()


if __name__ == "__main__":
    main(sys.argv[1], scenario)
