"""Ranks of tests/dist/engines/test_eng_cp_gather.py: Megatron's context-parallel group on 2 gloo
ranks (tp 1, cp 2, dp 1) and the split / gather of engines/megatron/context_parallel.py through it.
Each rank splits the same [B, S] batch, gathers its share back, and backpropagates a weighted sum
of the gathered result; it runs the engine's CP output path against the whole-sequence one
(a stand-in model); then it tries to build a MegatronEngine at cp 2 (refused: no
Transformer Engine). It writes what it saw to rank{r}.json."""
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
    out["outputs"] = _outputs_vs_whole_sequence(group)
    out["refusal"] = _engine_refusal()
    (Path(workdir) / f"rank{ctx.rank}.json").write_text(json.dumps(out))
    dist.barrier()
    destroy_model_parallel()
    dist.destroy_process_group()


def _outputs_vs_whole_sequence(group) -> dict:
    """The engine's CP output path (schedule.MicroBatch's split, context_parallel.outputs) against
    the cp 1 path (outputs.py on the whole sequence), with a stand-in for the model: a fixed
    random function of each token's id and position, so that this rank's output rows are the
    whole sequence's rows at its tokens. Max differences of the values and of the gradient of a
    loss (per token, w.r.t. the stand-in's parameters after the sum over the CP group)."""
    import torch
    import torch.distributed as dist

    from verl_hpc.engines.batch import get_response_mask, pack_sequences
    from verl_hpc.engines.megatron import context_parallel as cpl
    from verl_hpc.engines.megatron import outputs as lm
    from verl_hpc.engines.megatron.schedule import MicroBatch
    from verl_hpc.engines.outputs import value_outputs

    g = torch.Generator().manual_seed(5)
    vocab, n = 11, 3
    prompts = [torch.randint(1, vocab, (int(k),), generator=g).tolist() for k in (3, 5, 2)]
    resps = [torch.randint(1, vocab, (int(k),), generator=g).tolist() for k in (6, 2, 9)]
    batch = pack_sequences(prompts, resps)
    batch["response_mask"] = get_response_mask(batch)
    table = torch.randn(vocab, vocab, generator=g, dtype=torch.float64)
    pos_w = torch.randn(64, vocab, generator=g, dtype=torch.float64)
    whole = MicroBatch(batch, list(range(n)), "cpu", pad_seq_to=4)
    mine = MicroBatch(batch, list(range(n)), "cpu", pad_seq_to=4, cp_group=group)
    diffs = {"shape_equal": mine.shape == whole.shape,
             "labels_split": bool(torch.equal(
                 mine.data["_cp_labels"],
                 cpl.split_for_rank({"l": whole.data["_labels"]}, group)["l"]))}

    def model(ids, pos, params):
        return params[0][ids] + params[1][pos]  # [b, s, vocab]: each row depends on its own token only

    for kind in ("lm", "labels", "value"):
        grads = []
        for m, cp_path in ((whole, False), (mine, True)):
            params = [table.clone().requires_grad_(True), pos_w.clone().requires_grad_(True)]
            out = model(m.model_input_ids, m.model_position_ids, params)
            want = ("log_probs", "entropy") if kind == "lm" else ("log_probs",) if kind == "labels" else ("values",)
            if kind == "labels":  # Megatron's per-position loss: -log p(label)
                labels = m.data["_cp_labels"] if cp_path else m.data["_labels"]
                out = -torch.log_softmax(out, -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
            if kind == "value":
                out = out[..., :1]
            if cp_path:
                res = cpl.outputs(out, m.data, want, kind=kind)
            else:
                res = (lm.lm_outputs(out, m.data, want) if kind == "lm" else
                       lm.lm_outputs_from_token_losses(out, m.data, want) if kind == "labels" else
                       value_outputs(out, m.data, want))
            loss = sum((v.double() * (1 + torch.arange(v.numel(), dtype=torch.float64).view_as(v))).sum()
                       for v in res.values())
            loss.backward()
            gr = torch.cat([p.grad.flatten() for p in params])
            if cp_path:  # DDP adds the CP ranks' gradients (dp x cp group)
                dist.all_reduce(gr, group=group)
            grads.append((res, gr))
        (r1, g1), (r2, g2) = grads
        diffs[kind] = {"value": max(float((r1[k].double() - r2[k].double()).abs().max()) for k in r1),
                       "grad": float((g1 - g2).abs().max()), "grad_scale": float(g1.abs().max())}
    return diffs


def _engine_refusal() -> dict:
    """MegatronEngine at cp 2 on this CPU node: its error, and whether any weight was built first."""
    from verl_hpc.engines.megatron import MegatronEngine, wiring
    from verl_hpc.engines.options import default_options
    from verl_hpc.errors import VerlHpcError

    built = []
    real = wiring.build_chunks
    wiring.build_chunks = lambda *a, **k: built.append(1) or real(*a, **k)
    try:
        MegatronEngine(default_options("/no/model/folder"))
    except VerlHpcError as e:
        return {"type": type(e).__name__, "message": str(e), "built": bool(built)}
    finally:
        wiring.build_chunks = real
    return {"type": None, "message": "", "built": bool(built)}


if __name__ == "__main__":
    main(sys.argv[1])
