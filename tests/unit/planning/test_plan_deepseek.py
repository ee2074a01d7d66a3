"""The memory plan of DeepSeek-V3 (multi-head latent attention, the router's per-expert bias, dense
first layers): the planner's parameter count equals a real checkpoint's, the latent KV cache is
kv_lora_rank + qk_rope_head_dim per token and layer on every rollout rank, the known 671B shape
counts what DeepSeek publishes, and configs/grpo_deepseek_v3.yaml's node count is the fewest that
fit."""
import math
from pathlib import Path

from verl_hpc.config import load_config
from verl_hpc.planning import MARGIN, plan_job

REPO = Path(__file__).resolve().parents[3]


def test_planner_counts_equal_a_deepseek_checkpoint(tmp_path):
    from safetensors import safe_open

    from verl_hpc.models.config_mapping import load_arch
    from verl_hpc.models.tiny import make_tiny_model
    from verl_hpc.planning.model_shape import stage_tensor_sizes, total_params

    for q_lora in (64, None):
        folder = make_tiny_model(tmp_path / f"ds{q_lora}", "deepseek_v3", q_lora_rank=q_lora)
        with safe_open(str(folder / "model.safetensors"), "pt") as f:
            shapes = [f.get_slice(n).get_shape() for n in f.keys()]
        arch = load_arch(folder)
        stored = sum(math.prod(s) for s in shapes)
        assert total_params(arch) == stored
        # one rank of one stage at tp 1: every checkpoint tensor (gate and up fused: one tensor per
        # MLP, 6 here), plus the embedding's and output layer's vocabulary padding (500 -> 512 rows)
        sizes = stage_tensor_sizes(arch, 1, 1, 0)
        assert len(sizes) == len(shapes) - 6 and sum(sizes) == stored + 2 * 12 * arch.hidden_size
        # pipeline stage 0 holds the dense layer, stage 1 the MoE layer: they differ
        assert stage_tensor_sizes(arch, 1, 2, 0) != stage_tensor_sizes(arch, 1, 2, 1)


def test_latent_kv_cache_and_the_known_shape():
    from verl_hpc.planning.model_shape import KNOWN, known_arch, total_params
    from verl_hpc.planning.rollout import kv_bytes_per_token, kv_sequence_bytes

    ds = known_arch("/models/DeepSeek-V3-0324-bf16")
    assert ds is KNOWN["deepseek-v3"]
    assert 670.5e9 < total_params(ds) < 671.5e9  # DeepSeek-V3's 671B (its MTP module aside)
    assert kv_bytes_per_token(ds, 2) == 61 * (512 + 64) * 2
    # the latent is not split over heads: the same per rank at any inference TP
    assert kv_sequence_bytes(ds, 4096, 8, 2) == kv_sequence_bytes(ds, 4096, 32, 2)


def test_the_deepseek_config_fits_and_16_nodes_do_not():
    cfg = REPO / "configs/grpo_deepseek_v3.yaml"
    plan = plan_job(load_config(str(cfg), []))
    assert plan.fits(margin=MARGIN) and load_config(str(cfg), []).slurm.nodes == 32
    half = plan_job(load_config(str(cfg), ["slurm.nodes=16", "parallel.ep=128"]))
    assert not half.fits(), half.peak / 2 ** 30
