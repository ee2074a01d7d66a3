"""Analytical payload bytes of the collectives of one RL step, per rank (docs/scaling.md).

The same functions are checked against the bytes counted on real tiny runs
(benchmarks/bench_scaling.py, which wraps every torch.distributed call) and evaluated for the
flagship layout (`python benchmarks/scaling_formulas.py configs/ppo_70b.yaml`).

Payload = what one rank hands to one collective (runtime/collectives.py): all-reduce/broadcast/p2p
the tensor, reduce-scatter the full input, all-gather the full output. Time on a link of bus
bandwidth B follows from the algorithm: ring all-reduce 2(n-1)/n x payload / B, reduce-scatter and
all-gather (n-1)/n x payload / B, broadcast (pipelined) payload / B, p2p payload / B.
"""
from __future__ import annotations

import dataclasses
import json
import math
import sys
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class Model:
    hidden: int
    layers: int
    ffn: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool = False
    qkv_bias: bool = False
    # mixture of experts (Mixtral, Qwen2-MoE, Qwen3-MoE): routed experts of FFN expert_ffn, top_k
    # per token; the dense MLP of layer_params() is then the shared expert (shared_ffn, 0 = none)
    experts: int = 0
    top_k: int = 0
    expert_ffn: int = 0
    qk_norm: bool = False

    @classmethod
    def from_hf(cls, folder_or_dict) -> "Model":
        c = folder_or_dict if isinstance(folder_or_dict, dict) else \
            json.loads((Path(folder_or_dict) / "config.json").read_text())
        h, n = c["hidden_size"], c["num_attention_heads"]
        experts = int(c.get("num_local_experts") or c.get("num_experts") or 0)
        moe = dict(experts=experts, top_k=int(c.get("num_experts_per_tok", 0)),
                   expert_ffn=int(c.get("moe_intermediate_size") or c["intermediate_size"]),
                   qk_norm=c.get("model_type") == "qwen3_moe") if experts else {}
        ffn = int(c.get("shared_expert_intermediate_size") or 0) if experts else c["intermediate_size"]
        return cls(hidden=h, layers=c["num_hidden_layers"], ffn=ffn, heads=n,
                   kv_heads=c.get("num_key_value_heads", n), head_dim=c.get("head_dim") or h // n,
                   vocab=c["vocab_size"], tied=bool(c.get("tie_word_embeddings", False)),
                   qkv_bias=bool(c.get("attention_bias", c.get("model_type") in ("qwen2", "qwen2_moe"))), **moe)

    def layer_params(self) -> dict[str, tuple[int, bool]]:
        """{name: (elements, split by TP)} of one transformer layer (Llama: SwiGLU, GQA, RMSNorm),
        routed experts apart (expert_params): in the data-parallel gradient buffer."""
        h, hd = self.hidden, self.head_dim
        out = {"qkv": (h * (self.heads + 2 * self.kv_heads) * hd, True), "proj": (self.heads * hd * h, True),
               "fc1": (2 * self.ffn * h, True), "fc2": (self.ffn * h, True), "norms": (2 * h, False)}
        if self.experts:
            out["router"] = (self.experts * h, False)
            if self.qk_norm:  # two tensors: each starts at a multiple of 64 in Megatron's buffer
                out["q_norm"], out["k_norm"] = (hd, False), (hd, False)
            if not self.ffn:
                del out["fc1"], out["fc2"]
        return out

    def expert_params(self, ep: int = 1) -> int:
        """Routed-expert elements of one layer on one expert-parallel rank (no expert TP)."""
        return self.experts // max(ep, 1) * 3 * self.expert_ffn * self.hidden if self.experts else 0

    def hf_params(self) -> int:
        per_layer = sum(n for n, _ in self.layer_params().values()) + self.expert_params()
        bias = (self.heads + 2 * self.kv_heads) * self.head_dim if self.qkv_bias else 0
        return self.layers * (per_layer + bias) + self.hidden + self.vocab * self.hidden * (1 if self.tied else 2)


@dataclasses.dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    dp: int = 1
    vpp: int = 1
    ep: int = 1  # expert parallel (expert TP = 1 in these formulas)


def padded_vocab(vocab: int, tp: int, divisible_by: int = 128) -> int:
    """Megatron pads the vocabulary to a multiple of make_vocab_size_divisible_by x TP."""
    m = divisible_by * tp
    return math.ceil(vocab / m) * m


def rank_params(m: Model, lay: Layout, stage: int) -> list[tuple[int, bool]]:
    """(elements on this rank, TP-split) of every parameter of pipeline stage `stage`."""
    out = []
    if stage == 0:
        out.append((padded_vocab(m.vocab, lay.tp) * m.hidden // lay.tp, True))
    for _ in range(m.layers // lay.pp):
        out += [(n // lay.tp if split else n, split) for n, split in m.layer_params().values()]
    if stage == lay.pp - 1:
        out.append((m.hidden, False))
        if not m.tied:
            out.append((padded_vocab(m.vocab, lay.tp) * m.hidden // lay.tp, True))
    return out


def dist_opt_buffer(m: Model, lay: Layout, stage: int = 0) -> int:
    """Elements of the distributed optimizer's grad/param buffer on one rank: every parameter
    starts at a multiple of 64 elements and the buffer ends at a multiple of lcm(DP, 128)
    (megatron-core param_and_grad_buffer; one bucket: the tiny models fit one). An MoE model's
    routed experts are in a buffer of their own over the expert data-parallel group."""
    index = 0
    for n, _ in rank_params(m, lay, stage):
        index = math.ceil(index / 64) * 64 + n
    div = math.lcm(lay.dp, 128)
    return math.ceil(index / div) * div


def optimizer_bytes(m: Model, lay: Layout, grad_bytes: int, param_bytes: int, stage: int = 0) -> dict:
    """Per optimizer step: grads reduce-scattered and params all-gathered over the DP group."""
    if lay.dp == 1:
        return {}
    n = dist_opt_buffer(m, lay, stage)
    return {("reduce_scatter_tensor", "dp"): n * grad_bytes, ("all_gather_into_tensor", "dp"): n * param_bytes}


def resharding_bytes(m: Model, lay: Layout, dtype_bytes: int, stage: int = 0) -> dict:
    """One weight sync (models/weights.py export): each TP-split parameter of the stage is
    all-gathered whole (padded vocabulary included), then with PP every full HF tensor of every
    stage is broadcast over the PP group (every rank takes part in every broadcast)."""
    out = {}
    if lay.tp > 1:
        out[("all_gather", "tp")] = sum(n * lay.tp for n, split in rank_params(m, lay, stage) if split) * dtype_bytes
    if lay.pp > 1:
        out[("broadcast", "pp")] = m.hf_params() * dtype_bytes
    return out


def rollout_shard_elements(m: Model, infer_tp: int, tp_rank: int = 0) -> int:
    """Elements of the model that inference-TP rank `tp_rank` of `infer_tp` keeps (vLLM's cut):
    column- and row-parallel weights 1/tp each, whole KV heads replicated when there are fewer
    than tp, norms whole, and the rank's range of the vocabulary padded to 64 rows and split
    evenly (the padding is not sent). What the sliced weight sync delivers to that rank."""
    h, hd, f, tp = m.hidden, m.head_dim, m.ffn, infer_tp
    kv_rows = (m.kv_heads * hd // tp) if m.kv_heads >= tp else hd
    q_rows = m.heads * hd // tp
    layer = (q_rows + 2 * kv_rows) * h + m.heads * hd * h // tp + 3 * f * h // tp + 2 * h
    if m.experts:  # every expert cut like a dense MLP; the router and q/k norms whole
        layer += m.expert_params() // tp + m.experts * h + (2 * hd if m.qk_norm else 0)
    if m.qkv_bias:
        layer += q_rows + 2 * kv_rows
    per = math.ceil(m.vocab / 64) * 64 // tp
    vocab_rows = max(0, min((tp_rank + 1) * per, m.vocab) - min(tp_rank * per, m.vocab))
    return m.layers * layer + h + vocab_rows * h * (1 if m.tied else 2)


def sliced_sync_bytes(m: Model, lay: Layout, infer_tp: int, dtype_bytes: int) -> dict:
    """One sliced weight sync, colocated, on a rank whose rollout TP equals its training TP (the
    flagship): it receives its shard; the tensors of its own pipeline stage are cut exactly as it
    holds them (same column/row splits), so they come from itself, and the rest come from the
    same TP rank of the other stages in its data-parallel replica (one all_to_all per bucket).
    Returns {"received": shard, "wire": from other stages}, per rank, worst stage."""
    shard = rollout_shard_elements(m, infer_tp) * dtype_bytes
    if lay.pp == 1 or infer_tp != lay.tp:
        return {"received": shard, "wire": 0 if infer_tp == lay.tp else None}
    per_layer = (rollout_shard_elements(m, infer_tp) - m.hidden
                 - rollout_shard_elements(dataclasses.replace(m, layers=0), infer_tp)) // m.layers
    vocab = (rollout_shard_elements(dataclasses.replace(m, layers=0), infer_tp) - m.hidden)
    embed = vocab if m.tied else vocab // 2
    # the first stage holds the embedding, the last the final norm and lm_head: the larger of the
    # two remote parts
    first_remote = m.layers * (lay.pp - 1) // lay.pp * per_layer + m.hidden + (0 if m.tied else vocab - embed)
    last_remote = m.layers * (lay.pp - 1) // lay.pp * per_layer + embed
    return {"received": shard, "wire": max(first_remote, last_remote) * dtype_bytes}


def sliced_sent_bytes(m: Model, lay: Layout, dtype_bytes: int, stage: int = 0, tp_rank: int = 0) -> int:
    """What one rank hands to the sliced sync's all_to_all (its own slices excluded: they never
    leave it) when every rank keeps whole tensors (inference TP 1, e.g. the HF rollout): every
    other rank of its data-parallel replica (tp x pp - 1 of them) takes this rank's real part of
    each TP-split tensor of its stage (Megatron's padding rows excluded), and the ranks of the
    other stages (tp x (pp - 1)) take the stage's norms from its TP rank 0."""
    vocab_per = padded_vocab(m.vocab, lay.tp) // lay.tp
    vocab_rows = max(0, min((tp_rank + 1) * vocab_per, m.vocab) - tp_rank * vocab_per)
    split = sum(n // lay.tp for n, s in m.layer_params().values() if s) * (m.layers // lay.pp)
    if m.qkv_bias:
        split += (m.heads + 2 * m.kv_heads) * m.head_dim // lay.tp * (m.layers // lay.pp)
    norms = 2 * m.hidden * (m.layers // lay.pp)
    if stage == 0:
        split += vocab_rows * m.hidden
    if stage == lay.pp - 1:
        norms += m.hidden
        if not m.tied:
            split += vocab_rows * m.hidden
    others = lay.tp * lay.pp - 1
    # an MoE model at tp = pp = 1 whose experts are held once (ep = dp): every other rank takes
    # this rank's experts of every layer (the rest it holds itself)
    experts = m.expert_params(lay.ep) * m.layers * (lay.dp - 1) if m.experts and lay.ep > 1 else 0
    if experts and not (lay.tp == lay.pp == 1 and lay.ep == lay.dp):
        raise ValueError("sliced_sent_bytes counts experts for tp = pp = 1 and ep = dp only")
    return (split * others + (norms * lay.tp * (lay.pp - 1) if tp_rank == 0 else 0) + experts) * dtype_bytes


def tp_activation_bytes(m: Model, lay: Layout, tokens: int, act_bytes: int, backward: bool,
                        stage: int = 0, resp_tokens: int = 0, logprob_scalars: int = 6,
                        update_scalars: int = 3) -> int:
    """TP all-reduces of one pass over `tokens` tokens on one rank of pipeline stage `stage`:
    forward 2 per layer (attention and MLP row-parallel outputs) + the vocab-parallel embedding
    (first stage); backward another 2 per layer (column-parallel input grads) + the output
    layer's input grad (last stage), which the engine runs over the response tokens only
    (`resp_tokens`; all `tokens` when not given). The last stage's vocab-parallel statistics are
    one-value all-reduces per response token: `logprob_scalars` in a forward-only pass (log-softmax
    max, sum and target, and the entropy's), `update_scalars` in an update (the log-softmax's,
    forward only: no entropy without an entropy bonus, and no all-reduce in their backward).
    With sequence parallelism each all-reduce becomes a reduce-scatter + all-gather of the same
    payload."""
    if lay.tp == 1:
        return 0
    first, last = stage == 0, stage == lay.pp - 1
    layers = m.layers // lay.pp
    scalars = (update_scalars if backward else logprob_scalars) * resp_tokens * 4 if last else 0  # fp32
    out = (2 * layers + first) * tokens * m.hidden * act_bytes + scalars
    if backward:
        out += (2 * layers * tokens + last * (resp_tokens or tokens)) * m.hidden * act_bytes
    return out


def moe_alltoall_bytes(layers: int, hidden: int, top_k: int, tokens: int, act_bytes: int,
                       backward: bool, etp: int = 1) -> int:
    """The alltoall token dispatcher of an MoE model, summed over the ranks of an expert-parallel
    group (Megatron's MoEAlltoAllTokenDispatcher, dropless). Per MoE layer and forward, each rank
    hands the dispatch all_to_all its tokens' top_k copies [T_r * k, h] and the combine all_to_all
    the expert outputs of the copies routed to its experts; over the group both sum to T * k rows,
    T = the group's tokens. The backward runs both again on the gradients. Per rank the split is
    the router's (data dependent); the group's sum is not. With expert TP each row also goes
    through the etp group's gather (not counted here: etp = 1)."""
    if etp != 1:
        raise ValueError("moe_alltoall_bytes counts etp = 1 only")
    per_forward = 2 * layers * tokens * top_k * hidden * act_bytes
    return per_forward * (2 if backward else 1)


def ulysses_kv_repeats(m: Model, sp: int) -> int:
    """How many times the FSDP engine's Ulysses attention repeats each KV head before regrouping
    (engines/fsdp/ulysses.py kv_repeats): 1 when the KV heads split over sp, else sp / kv."""
    return 1 if m.kv_heads % sp == 0 else sp // m.kv_heads


def ulysses_alltoall_bytes(m: Model, sp: int, microbatches, act_bytes: int, backward: bool,
                           recompute: bool = False) -> int:
    """The FSDP engine's Ulysses all-to-alls (fsdp.sp) in one pass, per rank of a sequence group.
    `microbatches`: (rows, padded length) of each micro-batch the rank runs (a length a multiple
    of sp: the engine right-pads each micro-batch to its longest row, rounded up to sp). Per
    decoder layer the forward hands 4 all-to-alls this rank's slice of S/sp tokens: q [B, H,
    S/sp, D], k and v [B, KV x r, S/sp, D] (r = ulysses_kv_repeats), and the attention output
    [B, H/sp, S, D] (as many elements as q). The backward runs the same 4 exchanges on the
    gradients; activation checkpointing (`recompute`) runs the forward's again in the backward.
    Of each payload (sp-1)/sp crosses the wire (the rank's own part stays)."""
    if sp == 1:
        return 0
    tokens = sum(rows * length for rows, length in microbatches)
    heads = 2 * m.heads + 2 * m.kv_heads * ulysses_kv_repeats(m, sp)  # q, out; k, v
    forward = m.layers * tokens * heads * m.head_dim * act_bytes // sp
    return forward * ((2 + int(recompute)) if backward else 1)


def pp_p2p_bytes(m: Model, lay: Layout, tokens: int, act_bytes: int, backward: bool, sp: bool = False) -> int:
    """Activations one rank sends or receives across pipeline boundaries in one pass: pp*vpp - 1
    chunk boundaries per micro-batch, each with a sender and a receiver, spread over pp ranks
    (pp=2, vpp=1: the first stage sends once; pp=2, vpp=5: 9 per rank). Backward sends the
    gradients back the same way. With sequence parallelism each TP rank moves 1/tp of it."""
    if lay.pp == 1:
        return 0
    ends = 2 * (lay.pp * lay.vpp - 1)
    return ends * tokens * m.hidden * act_bytes * (2 if backward else 1) // lay.pp // (lay.tp if sp else 1)


# ------------------------------------------------------------------ the 70B estimate
LLAMA3_70B = Model(hidden=8192, layers=80, ffn=28672, heads=64, kv_heads=8, head_dim=128, vocab=128256)


def estimate(cfg: dict, m: Model = LLAMA3_70B, nvlink_gbs: float = 360.0, ib_gbs: float = 40.0) -> list[dict]:
    """Bytes and seconds per stage of one PPO step for the config's layout. Bandwidths are bus
    bandwidths per GPU: NVLink 4 all-reduce ~360 GB/s on 8 H100 (NCCL tests), one 400 Gb/s NDR
    rail per GPU ~40 GB/s effective (of 50 GB/s). TP groups sit inside a node, DP and PP cross."""
    p, d, r = cfg["parallel"], cfg["data"], cfg["rollout"]
    world = cfg["slurm"]["nodes"] * cfg["slurm"]["tasks_per_node"]
    lay = Layout(tp=p["tp"], pp=p["pp"], dp=world // (p["tp"] * p["pp"]), vpp=p.get("vpp") or 1)
    seqs = d["train_batch_size"] * r.get("n", 1)
    tokens = seqs * (d["max_prompt_length"] + d["max_response_length"]) // lay.dp  # per DP replica
    opt_steps = d["train_batch_size"] // cfg["actor"]["ppo_mini_batch_size"]
    bf16 = 2
    tp_fwd = tp_activation_bytes(m, lay, tokens, bf16, False)
    pp_fwd = pp_p2p_bytes(m, lay, tokens, bf16, False, sp=bool(p.get("sequence_parallel")))
    ring = lambda n: 2 * (n - 1) / n  # noqa: E731
    rows = []

    def add(stage, what, payload, factor, gbs, link):
        rows.append(dict(stage=stage, collective=what, payload_gb=payload / 1e9,
                         seconds=payload * factor / (gbs * 1e9), link=link))

    models = [("actor", True), ("critic", bool(cfg.get("critic", {}).get("enable")))]
    passes = {"old_logprob": 1, "ref": 1}
    for stage, n in passes.items():
        add(stage, "TP all-reduce (activations)", tp_fwd * n, ring(lay.tp), nvlink_gbs, "NVLink")
        add(stage, "PP send/recv (activations)", pp_fwd * n, 1, ib_gbs, "IB")
    if models[1][1]:
        add("values", "TP all-reduce (activations)", tp_fwd, ring(lay.tp), nvlink_gbs, "NVLink")
        add("values", "PP send/recv (activations)", pp_fwd, 1, ib_gbs, "IB")
    for name, on in models:
        if not on:
            continue
        stage = f"update_{name}"
        add(stage, "TP all-reduce (activations, fwd+bwd)", 2 * tp_fwd, ring(lay.tp), nvlink_gbs, "NVLink")
        add(stage, "PP send/recv (activations, fwd+bwd)", 2 * pp_fwd, 1, ib_gbs, "IB")
        opt = optimizer_bytes(m, lay, grad_bytes=4, param_bytes=bf16)
        for (op, _), b in opt.items():
            add(stage, f"DP {op} x{opt_steps} optimizer steps", b * opt_steps, (lay.dp - 1) / lay.dp, ib_gbs, "IB")
    sliced = cfg.get("resharding", {}).get("mode", "auto") != "full"
    infer_tp = r.get("tp", 1)
    sync = sliced_sync_bytes(m, lay, infer_tp, bf16) if sliced else None
    if sync and sync["wire"] is not None:
        # its own stage's slices come from itself; the other stages' over IB (one all_to_all a bucket)
        add("sync", "sliced all_to_all: own slices, from this rank", sync["received"] - sync["wire"], 0, ib_gbs, "local")
        add("sync", "sliced all_to_all: other stages' slices", sync["wire"], 1, ib_gbs, "IB")
    else:  # the full-tensor path (resharding.mode: full, or a layout the sliced formula does not cover)
        for (op, grp), b in resharding_bytes(m, lay, bf16).items():
            factor, gbs, link = ((lay.tp - 1) / lay.tp, nvlink_gbs, "NVLink") if grp == "tp" else (1, ib_gbs, "IB")
            add("sync", f"resharding {op} ({grp})", b, factor, gbs, link)
    return rows


def main(argv: list[str]) -> int:
    from omegaconf import OmegaConf

    full = "--full-sync" in argv  # today's default is the sliced sync; this shows the full path
    argv = [a for a in argv if a != "--full-sync"]
    path = argv[0] if argv else "configs/ppo_70b.yaml"
    raw = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    base = OmegaConf.to_container(OmegaConf.load(Path(path).parent / raw.get("extends", "base.yaml")))
    cfg = OmegaConf.to_container(OmegaConf.merge(base, {k: v for k, v in raw.items() if k != "extends"}))
    if full:
        cfg.setdefault("resharding", {})["mode"] = "full"
    rows = estimate(cfg)
    print(f"| stage | collective | payload per rank (GB) | link | est. seconds |\n|---|---|---:|---|---:|")
    for r in rows:
        print(f"| {r['stage']} | {r['collective']} | {r['payload_gb']:.1f} | {r['link']} | {r['seconds']:.2f} |")
    by_stage: dict[str, float] = {}
    for r in rows:
        by_stage[r["stage"]] = by_stage.get(r["stage"], 0.0) + r["seconds"]
    print("\nseconds per stage: " + ", ".join(f"{k} {v:.1f}" for k, v in by_stage.items())
          + f"; total {sum(by_stage.values()):.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
