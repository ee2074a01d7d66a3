"""The FSDP part of the memory plan against what the FSDP engine really holds, on 2 gloo ranks,
5 layouts in one launch (verl_hpc/planning/fsdp.py; the Megatron plan's comparison is
test_eng_memory.py, in the same style and tolerances).

For every layout and rank: the bytes behind the actor's local weight shards, its gradients and
Adam's moments, and the reference's weight shards, within 5% of the plan's fp32 shards over the
shard group (HSDP: over the shard, not the world), the gradient shards an update leaves too; the
bytes the decoder layers keep for backward during a training forward within 15% of the layer
formula (with and without activation checkpointing, fp32 and bf16 compute); the gathered bytes in
flight (FSDP2's unsharded weights, pending all-gather buffers, unsharded gradients, reduce-scatter
inputs) at their peak in the forward and over forward + backward within 15% of the plan's gathered
figure (two layers in flight, or all of them without reshard_after_forward); an actor offloading
its weights, gradients and Adam states keeps nothing on the device while idle.
"""
import pytest
import torch

from fsdp_mem_ranks import launch
from verl_hpc.planning.fsdp import fsdp_params, gathered_bytes, layer_activation_bytes, state_bytes, tail_bytes
from verl_hpc.planning.model_shape import fsdp_arch

pytestmark = pytest.mark.no_vllm("the FSDP engine's memory: no rollout")

WORLD = 2
LAYOUTS = [
    dict(name="fsdp2", fsdp={}, offload=True),
    dict(name="fsdp2_checkpointing", fsdp=dict(activation_checkpointing=True)),
    dict(name="fsdp2_keep_gathered", fsdp=dict(reshard_after_forward=False)),
    dict(name="hsdp_2x1", fsdp=dict(shard_size=1)),
    dict(name="fsdp2_bf16", fsdp=dict(mixed_precision="bf16")),
]
ACT_SEQ, ACT_BATCH, ACT_PROMPT = 64, 2, 16
STATE_TOL, ACT_TOL, GATHER_TOL = 0.05, 0.15, 0.15


def _batch(n=8):
    from verl_hpc.engines.batch import get_response_mask, pack_sequences

    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(5, 400, (int(p),), generator=g).tolist() for p in torch.randint(3, 9, (n,), generator=g)]
    resps = [torch.randint(5, 400, (int(r),), generator=g).tolist() for r in torch.randint(2, 10, (n,), generator=g)]
    b = pack_sequences(prompts, resps)
    b["response_mask"] = get_response_mask(b)
    b["advantages"] = torch.randn(n, int(b["response_lengths"].max()), generator=g)
    return b


def _act_batch(rows):
    """Full-length rows of ACT_SEQ tokens: the micro-batch shape the activations are planned for."""
    from verl_hpc.engines.batch import get_response_mask, pack_sequences

    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(5, 400, (ACT_PROMPT,), generator=g).tolist() for _ in range(rows)]
    resps = [torch.randint(5, 400, (ACT_SEQ - ACT_PROMPT,), generator=g).tolist() for _ in range(rows)]
    b = pack_sequences(prompts, resps)
    b["response_mask"] = get_response_mask(b)
    return b


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from verl_hpc.models.tiny import make_tiny_model

    root = tmp_path_factory.mktemp("eng_fsdp_memory")
    folder = make_tiny_model(root / "llama", layers=4)
    work = root / "work"
    work.mkdir()
    torch.save(_batch(), work / "batch.pt")
    torch.save(_act_batch(WORLD * ACT_BATCH), work / "act_batch.pt")
    args = dict(model=str(folder), optim=dict(lr=0.05, eps=1e-3), layouts=LAYOUTS, world=WORLD,
                act_seq=ACT_SEQ, act_batch=ACT_BATCH)
    return {"ranks": launch(WORLD, args, work), "arch": fsdp_arch(str(folder))}


def _planned(arch, layout):
    fs = layout["fsdp"]
    shard = fs.get("shard_size") or WORLD
    c = 2 if fs.get("mixed_precision") == "bf16" else 4
    p = fsdp_params(arch)
    actor = state_bytes(p, shard, trainable=True)
    ref = state_bytes(p, shard, trainable=False)
    s, b = ACT_SEQ, ACT_BATCH
    if fs.get("activation_checkpointing"):
        layers = arch.num_layers * s * b * arch.hidden_size * c  # each layer's input
    else:
        layers = arch.num_layers * layer_activation_bytes(arch, s, b, c)
    keep = fs.get("reshard_after_forward", True)
    gathered = {f"gathered_{k}": gathered_bytes(p, c, reshard_after_forward=keep, train=train, shard=shard)
                for k, train in (("forward", False), ("step", True))}
    return {**{f"actor.{k}": v for k, v in actor.items()}, "ref.weights": ref["weights"],
            "layers": layers, **gathered}


def test_fsdp_bytes_match_the_plan(run):
    arch, rows, bad = run["arch"], [], []
    header = f"{'layout':<22}{'rank':>5}{'kind':>18}{'measured':>12}{'planned':>12}{'ratio':>8}"
    for layout in LAYOUTS:
        planned = _planned(arch, layout)
        for r in run["ranks"]:
            out = r["layouts"][layout["name"]]
            measured = {**{f"actor.{k}": v for k, v in out["actor"].items()}, "ref.weights": out["ref"]["weights"],
                        "layers": out["layers"], "gathered_forward": out["gathered_forward"],
                        "gathered_step": out["gathered_step"]}
            for kind, value in measured.items():
                tol = STATE_TOL if kind.startswith(("actor", "ref")) else (
                    ACT_TOL if kind == "layers" else GATHER_TOL)
                ratio = value / planned[kind]
                rows.append(f"{layout['name']:<22}{r['rank']:>5}{kind:>18}{value:>12,}{int(planned[kind]):>12,}"
                            f"{ratio:>8.3f}")
                if abs(ratio - 1) > tol:
                    bad.append(rows[-1])
            # the gradient shards an update leaves: what the plan's idle rows hold without grad_offload
            if abs(out["grads_after_update"] / planned["actor.grads"] - 1) > STATE_TOL:
                bad.append(f"{layout['name']} rank {r['rank']}: {out['grads_after_update']} gradient bytes after "
                           f"an update, planned {planned['actor.grads']}")
            if layout.get("offload"):  # idle: nothing on the device; resident: weights and Adam's states
                idle, resident = out["offloaded_idle"], out["offloaded_resident"]  # (grads: made by a backward)
                expected = {"params": planned["actor.weights"], "grads": 0, "optimizer": planned["actor.optimizer"]}
                if any(idle.values()) or any(abs(resident[k] - v) > STATE_TOL * max(v, 1) for k, v in expected.items()):
                    bad.append(f"{layout['name']} rank {r['rank']}: offloaded actor idle {idle}, resident {resident}, "
                               f"planned resident {expected}")
            # beyond the layers: RoPE's cos/sin and the final norm (the plan's tail) and the log-probs
            # the loss keeps (the logits column's, fp32 [b, T, V]): reported, bounded by the plan
            c = 2 if layout["fsdp"].get("mixed_precision") == "bf16" else 4
            outside = tail_bytes(arch, ACT_SEQ, ACT_BATCH, c) + ACT_SEQ * ACT_BATCH * arch.vocab_size * 4
            rows.append(f"{layout['name']:<22}{r['rank']:>5}{'outside layers':>18}{out['outside']:>12,}"
                        f"{int(outside):>12,}{out['outside'] / outside:>8.3f}")
            if out["outside"] > outside:
                bad.append(rows[-1])
    print("\n" + header + "\n" + "\n".join(rows))
    print("seconds per layout (rank 0):", {k: round(v["seconds"], 1) for k, v in run["ranks"][0]["layouts"].items()})
    assert not bad, "outside tolerance:\n" + header + "\n" + "\n".join(bad)
    assert arch.num_layers == 4
