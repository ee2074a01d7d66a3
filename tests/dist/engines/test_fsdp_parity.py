"""The FSDP engine at 1, 2 and 4 gloo ranks against one process of plain transformers in
float64 with torch's AdamW (tests/update_reference.py): one launch of real ranks per world size
(world size 1 in this process), every check in it (fsdp_ranks.py), weights within WEIGHT_TOL after
one step:

    fixed.llama, fixed.qwen2   fixed micro-batches; qwen2 with tied embeddings and q/k/v biases
    budget                     micro-batches of a token budget (rows spread by length over the ranks)
    uneven                     5 rows over 2 or 4 ranks, one row per micro-batch: some rank runs an
                               empty micro-batch (and at 4 ranks, three of them); the gradient clipped
    hsdp                       4 ranks as 2 replicas x 2 shards (fsdp.shard_size = 2)
    fixed.gpt2, fixed.gemma2   held-out architectures (tests/arch_matrix.py), tied: GPT-2's Conv1D
                               layers sharded, Gemma 2's sliding window (6 tokens) past which rows run

and a vision-language model (a tiny Qwen2.5-VL, image rows and a text row, one row per micro-batch,
the vision tower frozen): 2 and 4 ranks equal 1 rank within WEIGHT_TOL after one step (a trained
tower runs on one rank only: tests/unit/engines/test_fsdp_vlm.py);
plus the forward's log-probs and entropy against the float64 forward (LOGP_TOL, the Megatron
engine's bound). The vocabulary (502) does not divide by 4: FSDP's shards of the embedding and the
output layer are uneven. Adam's eps is 1 and only `uneven` clips, for the reasons of
tests/unit/engines/test_fsdp_engine.py; the one-rank checks of the engine's other switches are there.
"""
import pytest
import torch

from arch_matrix import make_arch
from fsdp_ranks import launch
from update_reference import hf_forward64, hf_update64, max_diff, policy_batch
from vlm_reference import image_batch

pytestmark = pytest.mark.no_vllm("parity of the FSDP engine: no rollout")

WORLDS = (1, 2, 4)
LOGP_TOL, WEIGHT_TOL = 2e-5, 1e-5
TEMPERATURE = 0.7
OPTIM = dict(lr=0.5, eps=1.0, clip_grad=0.0, weight_decay=0.01)
CLIP = 0.3  # the uneven check's max gradient norm: below its gradient's (asserted)
ACTOR = dict(ppo_mini_batch_size=8, entropy_coeff=0.01, use_kl_loss=True, kl_loss_coef=0.1)
MODELS = {"llama": dict(family="llama", layers=2, vocab_size=502),
          "qwen2": dict(family="qwen2", tied=True, layers=2, vocab_size=502, seed=1)}
HELD_OUT = ("gpt2", "gemma2")  # built by tests/arch_matrix.py, tied as released
CHECKS = ("fixed.llama", "fixed.qwen2", "budget", "uneven", "fixed.gpt2", "fixed.gemma2")
# check -> (model, batch, clipped)
REFERENCE_OF = {"fixed.llama": ("llama", "batch", False), "fixed.qwen2": ("qwen2", "batch", False),
                "budget": ("llama", "batch", False), "uneven": ("llama", "uneven", True),
                "hsdp": ("llama", "batch", False), "fixed.gpt2": ("gpt2", "batch", False),
                "fixed.gemma2": ("gemma2", "batch", False)}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from verl_hpc.algorithms import PolicyObjective
    from verl_hpc.config.schema import ActorConfig, OptimConfig
    from verl_hpc.models.tiny import make_tiny_model

    root = tmp_path_factory.mktemp("fsdp_parity")
    from verl_hpc.models.tiny_vlm import make_tiny_vlm

    folders = {name: make_tiny_model(root / name, **kw) for name, kw in MODELS.items()}
    folders["vlm"] = make_tiny_vlm(root / "vlm", "qwen2_5_vl")
    folders.update({arch: make_arch(root / arch, arch, tied=True) for arch in HELD_OUT})
    vlm_batch, _ = image_batch(folders["vlm"], seed=3, sizes=((70, 100), None, (56, 56), (84, 60, 60, 84), (56, 84)))
    data = {"batch": policy_batch(21, n=8), "uneven": policy_batch(22, n=5), "vlm": vlm_batch}
    loss = PolicyObjective.from_config(ActorConfig(**ACTOR))
    refs = {}
    for key in {(m, b, c) for m, b, c in REFERENCE_OF.values()}:
        model, batch, clipped = key
        optim = OptimConfig(**dict(OPTIM, clip_grad=CLIP if clipped else 0.0))
        refs[key] = hf_update64(folders[model], data[batch], loss, optim, TEMPERATURE)
    args = dict(models={k: str(v) for k, v in folders.items()}, fixed=["llama", "qwen2", *HELD_OUT], optim=OPTIM,
                clip_grad=CLIP, actor=ACTOR, temperature=TEMPERATURE, max_tokens=24)
    ranks = {}
    for world in WORLDS:
        work = root / f"world{world}"
        work.mkdir()
        torch.save(data, work / "batch.pt")
        ranks[world] = launch(world, args, work) if world > 1 else _one_rank_here(args, work)
    forward = hf_forward64(folders["llama"], data["batch"], TEMPERATURE)
    return {"root": root, "ranks": ranks, "refs": refs, "forward": forward, "folders": folders, "data": data}


def _one_rank_here(args, work):
    """The scenario at world size 1 in this process (a one-rank gloo world): a launch would add
    only its start-up (seconds of imports) to the same computation."""
    import torch.distributed as dist

    from fsdp_ranks import scenario

    dist.init_process_group("gloo", init_method=f"file://{work}/store", rank=0, world_size=1)
    try:
        out = {"rank": 0, "seconds": {}}
        scenario(args, work, out)
    finally:
        dist.destroy_process_group()
    return [out]


def _load(run, world, name):
    return torch.load(run["root"] / f"world{world}" / f"{name}.pt")


def _check(run, world, name, rank=0):
    return run["ranks"][world][rank]["checks"][name]


@pytest.mark.parametrize("world", WORLDS)
def test_forward_equals_float64_transformers(run, world):
    out, (logp, ent, mask) = _load(run, world, "forward"), run["forward"]
    for key, want in (("log_probs", logp), ("entropy", ent)):
        got = out[key].double()
        assert got.shape == want.shape
        assert float((got - want).abs().max()) <= LOGP_TOL, key
        assert bool((got[mask == 0] == 0).all()), f"{key}: padding must be zero"


@pytest.mark.parametrize("world, check", [(w, c) for w in WORLDS for c in CHECKS] + [(4, "hsdp")])
def test_one_update_equals_the_float64_reference(run, world, check):
    from safetensors.torch import load_file

    model, batch, clipped = REFERENCE_OF[check]
    want, norm = run["refs"][(model, batch, clipped)]
    got = _load(run, world, check)
    start = load_file(str(run["folders"][model] / "model.safetensors"))
    assert max(float((want[n] - start[n]).abs().max()) for n in want) > 100 * WEIGHT_TOL, "the step must move"
    assert max_diff(got, want) <= WEIGHT_TOL
    per_rank = [_check(run, world, check, r)["metrics"] for r in range(world)]
    assert all(m == per_rank[0] for m in per_rank), "metrics must be identical on every rank"
    assert per_rank[0]["grad_norm"] == pytest.approx(norm, rel=1e-5)
    assert per_rank[0]["nonfinite"] == 0.0
    if clipped:
        assert norm > 2 * CLIP, "the clip must act"


@pytest.mark.parametrize("world", WORLDS[1:])
def test_vision_language_update_equals_one_rank(run, world, check="vlm.frozen"):
    """Image rows: 2 and 4 ranks give the one-rank step's weights; the frozen vision tower stays
    bitwise the folder's and the language model moves."""
    from safetensors.torch import load_file

    one, got = _load(run, 1, check), _load(run, world, check)
    assert max_diff(got, one) <= WEIGHT_TOL
    start = load_file(str(run["folders"]["vlm"] / "model.safetensors"))
    moved = {part: any(not torch.equal(got[n], start[n]) for n in got if n.startswith(part))
             for part in ("model.visual.", "model.language_model.")}
    assert moved == {"model.visual.": False, "model.language_model.": True}
    rows = [_check(run, world, check, r)["microbatch_rows"] for r in range(world)]
    assert sum(map(sum, rows)) == 5


def test_the_checks_ran_the_layouts_they_name(run):
    """Not vacuous: every rank ran rows; uneven rows left some rank an empty micro-batch at 2 and
    4 ranks (at 4, three ranks had one row and an empty micro-batch); the token budget split the
    batch otherwise than fixed micro-batches; HSDP ran on a 2 x 2 (replicate, shard) mesh."""
    for world in WORLDS:
        ranks = range(world)
        for check in ("fixed.llama", "budget"):
            assert sum(sum(_check(run, world, check, r)["microbatch_rows"]) for r in ranks) == 8
        uneven = [_check(run, world, "uneven", r)["microbatch_rows"] for r in ranks]
        assert sum(map(sum, uneven)) == 5
        assert (sum(0 in rows for rows in uneven) > 0) == (world > 1), uneven
        assert _check(run, world, "fixed.llama")["mesh"] == [world]
    assert sorted(map(sorted, [_check(run, 4, "uneven", r)["microbatch_rows"] for r in range(4)])) == \
        [[0, 1], [0, 1], [0, 1], [1, 1]]
    fixed = [_check(run, 2, "fixed.llama", r)["microbatch_rows"] for r in range(2)]
    budget = [_check(run, 2, "budget", r)["microbatch_rows"] for r in range(2)]
    assert fixed != budget
    hsdp = _check(run, 4, "hsdp")
    assert hsdp["mesh"] == [2, 2] and hsdp["mesh_dims"] == ["replicate", "shard"]
