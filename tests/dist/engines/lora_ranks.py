"""Ranks of tests/dist/engines/test_eng_lora_parity.py: the LoRA actor at every layout in turn
(the layouts and helpers of eng_ranks.py). Per layout and model, global rank 0 saves the forward
outputs with a given adapter (`<layout>.forward.<model>.pt`) and the adapter after one actor update
(`<layout>.update.<model>.pt`, PEFT names). `llama_stock` is llama started (lora.init_from) from a
stock PEFT adapter, whose q/k/v (gate/up) A differ: the fused layers hold one A per module."""
from __future__ import annotations

import sys
from pathlib import Path

from eng_ranks import _actor_cfg, _engine, _save, _update, main, megatron_layout, run_check

LAYOUTS = (("tp1", 1, 1, None), ("tp2", 2, 1, None), ("pp2", 1, 2, None), ("pp2vpp2", 1, 2, 2),
           ("tp2pp2", 2, 2, None))
MODELS = ("llama", "qwen2_tied")
STOCK = "llama_stock"
# (layout, model) pairs that run: 2 virtual stages of 2 ranks need 4 layers (llama's); the stock
# adapter at TP 1 and TP 2 (each TP rank's B rows map to their own module's A)
CASES = ([(lay[0], m) for lay in LAYOUTS for m in MODELS if not (lay[3] and m == "qwen2_tied")]
         + [("tp1", STOCK), ("tp2", STOCK)])


def launch(world_size: int, args: dict, workdir: Path, timeout: float = 400):
    from rank_launcher import launch_ranks

    return launch_ranks(__file__, world_size, args, workdir, timeout=timeout, what="LoRA scenario")


def check_lora(args, layout, workdir, model, data) -> dict:
    from verl_hpc.config.schema import LoraConfig
    from verl_hpc.models.lora import load_adapter

    batch, adapter = data[f"batch.{model}"], data[f"adapter.{model}"]
    if model == STOCK:  # from its PEFT folder, as a job starts
        eng = _engine(args, "llama", lora=LoraConfig(**args["lora"], init_from=str(Path(workdir) / STOCK)))
        assert eng.lora.per_module_a
    else:
        eng = _engine(args, model, lora=LoraConfig(**args["lora"]), use_distributed_optimizer=True)
        load_adapter(eng.gpt_chunks, adapter)
    _save(workdir, f"{layout}.forward.{model}", eng.forward(batch, ("log_probs", "entropy")))
    metrics = _update(eng, _actor_cfg(args["actor"][model]), batch)
    _save(workdir, f"{layout}.update.{model}", {n: t.clone() for n, t in eng.export_adapter()})
    return {"loss": metrics["actor/loss"], "version": eng.adapter_version}


def scenario(args, workdir, out: dict) -> None:
    import torch

    data = torch.load(Path(workdir) / "batch.pt")
    for name, tp, pp, vpp in LAYOUTS:
        with megatron_layout(out, name, tp=tp, pp=pp, vpp=vpp) as rec:
            for model in [m for lay, m in CASES if lay == name]:
                run_check(rec, f"lora.{model}", check_lora, args, name, workdir, model, data)


if __name__ == "__main__":
    main(sys.argv[1], scenario)
