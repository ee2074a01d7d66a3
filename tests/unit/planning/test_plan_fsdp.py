"""The memory plan of an FSDP job (issue 50): which roles run on FSDP (parallel.engine, auto's rule
from the folder or, on a login node, from the known table), fp32 states divided over the shard
group (HSDP: over the shard, not the world), the gathered units, activations with and without
checkpointing, offload, the HSDP groups, and --suggest ranking FSDP layouts beside Megatron's.
What the engine really holds is compared in tests/dist/engines/test_eng_fsdp_memory.py."""
import json
from pathlib import Path

import pytest

from verl_hpc.config import ConfigError, load_config
from verl_hpc.planning import plan_job
from verl_hpc.planning import fsdp as fsdp_plan
from verl_hpc.planning.model_shape import KNOWN

REPO = Path(__file__).resolve().parents[3]
GRPO = str(REPO / "configs/grpo_8b.yaml")  # Llama-3-8B, 8 x H100, token budget 16384, ref on
FSDP = ["parallel.engine=fsdp", "parallel.tp=1", "parallel.sequence_parallel=false", "rollout.tp=1"]
PARTS = ("weights", "grads", "optimizer")
# Meta's published parameter count of Llama-3-8B (untied 128256 x 4096 embedding and output layer)
LLAMA3_8B_PARAMS = 8_030_261_248


def plan(*overrides, config=GRPO, **kw):
    return plan_job(load_config(config, list(overrides)), **kw)


def test_the_fsdp_count_is_the_published_parameter_count():
    p = fsdp_plan.fsdp_params(KNOWN["llama-3-8b"])
    assert p.total == LLAMA3_8B_PARAMS
    assert p.layers == 32 and p.root == 2 * 128256 * 4096 + 4096


@pytest.mark.parametrize("shard,world", [(0, 8), (4, 8), (2, 16), (8, 16)])
def test_states_are_fp32_and_divided_over_the_shard_group_not_the_world(shard, world):
    """16 bytes per parameter (fp32 weight = the master copy, fp32 grad, Adam's two moments), the
    reference 4; HSDP (shard < world): each replica holds the whole model over its own shard group."""
    nodes = world // 8
    p = plan(*FSDP, f"fsdp.shard_size={shard}", f"slurm.nodes={nodes}", *OFFLOAD_OFF)
    group = shard or world
    row = p.table["update_actor"]
    assert row["actor"] == pytest.approx(16 * LLAMA3_8B_PARAMS / group)
    assert p.table["ref_logprob"]["ref"] == pytest.approx(4 * LLAMA3_8B_PARAMS / group)
    assert any(f"{world // group} replicas x shard {group}" in n or (group == world and "FSDP over" in n)
               for n in p.notes)


OFFLOAD_OFF = ["actor.param_offload=false", "actor.optimizer_offload=false", "actor.grad_offload=false",
               "ref.param_offload=false"]


def test_gathered_units_two_layers_in_flight_or_all_without_reshard():
    arch = KNOWN["llama-3-8b"]
    p = fsdp_plan.fsdp_params(arch)
    assert p.out == 128256 * 4096 + 4096  # lm_head and the final norm: their grads come first
    bf16 = plan(*FSDP)
    # forward: the root and two layers' worth in bf16 (the computing layer and its all-gather buffer)
    assert bf16.table["old_logprob"]["gathered"] == pytest.approx((p.root + 2 * p.layer) * 2)
    # update: inside the backward, the root, lm_head's grads and per layer 2 c + 4 (the prefetched
    # layer, the grads and their fp32 reduce-scatter input); at its end the root's grads and their
    # fp32 reduce-scatter input, which for Llama-3-8B's 128k vocabulary is the larger
    inside = p.root * 2 + p.out * 2 + p.layer * (2 * 2 + 4)
    end = p.root * (2 + 4)
    assert end > inside
    assert bf16.table["update_actor"]["gathered"] == pytest.approx(end)
    assert fsdp_plan.gathered_bytes(p, 2, reshard_after_forward=True, train=True, shard=8) == max(inside, end)
    kept = plan(*FSDP, "fsdp.reshard_after_forward=false")
    assert kept.table["old_logprob"]["gathered"] == pytest.approx((p.root + 33 * p.layer) * 2)
    # without reshard every layer not yet through its backward stays gathered: the first one to
    # reduce holds the 31 others, its bf16 grads and their fp32 reduce-scatter input
    assert kept.table["update_actor"]["gathered"] == pytest.approx(
        p.root * 2 + p.out * 2 + p.layer * (31 * 2 + 2 + 4))
    # fp32 compute (fsdp.mixed_precision=fp32, or any CPU job): twice the bytes in a forward
    fp32 = plan(*FSDP, "fsdp.mixed_precision=fp32")
    assert fp32.table["old_logprob"]["gathered"] == pytest.approx(2 * bf16.table["old_logprob"]["gathered"])
    # a shard group of one rank gathers nothing ahead
    assert fsdp_plan.gathered_bytes(p, 2, reshard_after_forward=True, train=False, shard=1) == (p.root + p.layer) * 2
    # no gathered column on the Megatron engine
    assert all(r["gathered"] == 0 for r in plan().table.values())


def test_activation_checkpointing_keeps_one_input_per_layer():
    arch = KNOWN["llama-3-8b"]
    s, b = 4096, 4  # 16384-token budget of full-length rows
    off = plan(*FSDP).table["update_actor"]["activations"]
    on = plan(*FSDP, "fsdp.activation_checkpointing=true").table["update_actor"]["activations"]
    tail = fsdp_plan.tail_bytes(arch, s, b, 2)
    layer = fsdp_plan.layer_activation_bytes(arch, s, b, 2)
    assert off == pytest.approx(32 * layer + tail)
    assert on == pytest.approx(32 * s * b * 4096 * 2 + tail + layer)
    assert on < off / 10
    # the per-token terms written out for Llama-3-8B in bf16 (h 4096, 32 q / 8 kv heads of 128, ffn 14336)
    per_token = 2 * ((4 + 4) * 4096 + 4) + 2 * (2 * 4096 + 2 * 1024) + 4 * 32 + 4 * 14336 * 2
    assert layer == s * b * per_token


def test_offload_while_idle_and_fsdp_cpu_offload():
    on = plan(*FSDP, "actor.param_offload=true", "actor.optimizer_offload=true", "actor.grad_offload=true")
    no_grads = plan(*FSDP, "actor.param_offload=true", "actor.optimizer_offload=true", "actor.grad_offload=false")
    off = plan(*FSDP, *OFFLOAD_OFF)
    # idle (rollout): offloaded weights and Adam states leave the device, grad_offload frees the
    # gradient shards an update leaves; without it they stay
    assert on.table["rollout"]["actor"] == 0
    assert no_grads.table["rollout"]["actor"] == pytest.approx(4 * LLAMA3_8B_PARAMS / 8)
    assert off.table["rollout"]["actor"] == pytest.approx(16 * LLAMA3_8B_PARAMS / 8)
    # fsdp.cpu_offload: the states never reach the device, the host holds them (pinned weight and
    # grad shards, plain Adam states) on every rank of the node
    cpu = plan(*FSDP, *OFFLOAD_OFF, "fsdp.cpu_offload=true")
    assert cpu.table["update_actor"]["actor"] == 0 and cpu.table["update_actor"]["gathered"] > 0
    extra = cpu.host["rollout"] - off.host["rollout"]
    assert extra >= 8 * 20 * LLAMA3_8B_PARAMS / 8  # actor 16 + reference 4 bytes per parameter, per rank


def test_hsdp_counts_a_shard_and_a_replicate_communicator_per_role():
    from verl_hpc.planning import hardware

    plain = plan(*FSDP, "slurm.nodes=2")
    hsdp = plan(*FSDP, "slurm.nodes=2", "fsdp.shard_size=8")
    # actor: shard + replicate in use; reference: shard in use, its replicate group idle
    added = 3 * hardware.NCCL_COMM_BYTES + hardware.NCCL_IDLE_COMM_BYTES
    assert hsdp.table["update_actor"]["nccl"] - plain.table["update_actor"]["nccl"] == pytest.approx(added)
    assert any("actor_fsdp_replicate" in n for n in hsdp.notes)
    # no Megatron groups on an all-FSDP job
    assert not any("tp_dp" in n for n in plain.notes)


def _folder(tmp_path, architecture, **extra):
    cfg = {"architectures": [architecture], "model_type": architecture.split("For")[0].lower(),
           "vocab_size": 32000, "hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 8,
           "num_attention_heads": 16, "num_key_value_heads": 4, "max_position_embeddings": 8192,
           "tie_word_embeddings": False, **extra}
    folder = tmp_path / architecture
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(cfg))
    return str(folder)


SMALL = ["data.max_prompt_length=512", "data.max_response_length=512", "actor.max_tokens_per_microbatch=4096"]


def test_auto_picks_fsdp_without_model_parallelism_from_the_folder_or_the_known_table(tmp_path):
    llama = _folder(tmp_path, "LlamaForCausalLM")
    assert plan("parallel.engine=auto", f"model.path={llama}", *FSDP[1:], *SMALL).table["update_actor"]["gathered"] > 0
    assert plan("parallel.engine=auto", f"model.path={llama}", *SMALL).table["update_actor"]["gathered"] == 0  # tp 2
    # a login node without the folder: the known table's name decides the shape, the layout the engine
    login = "/cluster/models/Meta-Llama-3-8B-Instruct"
    assert plan("parallel.engine=auto", f"model.path={login}", *FSDP[1:]).table["update_actor"]["gathered"] > 0
    assert plan("parallel.engine=auto", f"model.path={login}").table["update_actor"]["gathered"] == 0


def test_a_model_megatron_does_not_map_is_planned_on_fsdp(tmp_path):
    gemma = _folder(tmp_path, "Gemma3ForCausalLM", head_dim=256, hidden_act="gelu_pytorch_tanh",
                    sliding_window=512, tie_word_embeddings=True)
    p = plan("parallel.engine=auto", f"model.path={gemma}", *FSDP[1:], *SMALL)
    # tied: the root holds the embedding once; head_dim 256 x 16 heads, not hidden / heads
    params = fsdp_plan.fsdp_params(fsdp_plan_arch(gemma))
    assert params.root == 32000 * 1024 + 1024
    assert params.layer == 1024 * (16 + 8) * 256 + 16 * 256 * 1024 + 3 * 4096 * 1024 + 2 * 1024
    assert p.table["update_actor"]["actor"] == pytest.approx(16 * params.total / 8)
    with pytest.raises(ConfigError, match="not mapped"):
        plan("parallel.engine=megatron", f"model.path={gemma}", *SMALL)


def fsdp_plan_arch(path):
    from verl_hpc.planning.model_shape import fsdp_arch

    return fsdp_arch(path)


def test_suggest_ranks_fsdp_layouts_beside_megatron_and_each_fits(tmp_path):
    from verl_hpc.planning.suggest import suggest

    cands = suggest(load_config(GRPO, []))
    engines = {c.engine for c in cands}
    assert engines == {"megatron", "fsdp"}
    fsdp = [c for c in cands if c.engine == "fsdp"]
    assert {c.recompute for c in fsdp} <= {"none", "full"} and any(c.shard == 0 for c in fsdp)
    best = fsdp[0]
    again = plan(*best.overrides().split())
    assert again.fits(margin=0.10) and again.checked_peak() == pytest.approx(best.peak)
    assert "parallel.engine=fsdp" in best.overrides() and "fsdp.shard_size=" in best.overrides()
    # a model only FSDP trains: FSDP layouts only
    gemma = _folder(tmp_path, "Gemma3ForCausalLM", hidden_act="gelu_pytorch_tanh")
    only = suggest(load_config(GRPO, [f"model.path={gemma}", "parallel.engine=auto", *FSDP[1:], *SMALL]),
                   time_limit_s=2.0)
    assert only and {c.engine for c in only} == {"fsdp"}


def test_the_cli_plans_an_fsdp_job_without_torch():
    """A login node: torch unimportable; the FSDP job fits with activation checkpointing, and
    without it the refusal names the activations."""
    import subprocess
    import sys

    no_torch = ("import sys, runpy; sys.modules['torch'] = None; sys.argv = ['verl_hpc.plan'] + sys.argv[1:]; "
                "runpy.run_module('verl_hpc.plan', run_name='__main__')")

    def run(*args):
        return subprocess.run([sys.executable, "-c", no_torch, GRPO, *FSDP, *args], cwd=REPO,
                              capture_output=True, text=True, timeout=120)

    ok = run("fsdp.activation_checkpointing=true")
    assert ok.returncode == 0, ok.stderr
    assert "gathered" in ok.stdout and "FSDP engine (actor, ref)" in ok.stdout
    bad = run("fsdp.activation_checkpointing=false")
    assert bad.returncode == 1 and "largest component activations" in bad.stderr, bad.stderr


def test_the_planned_fsdp_adapter_is_what_peft_attaches(tmp_path):
    """LoRA on the FSDP engine: PEFT's adapters on transformers' projections (q, k, v apart; gate and
    up apart), counted by PEFT itself on the model transformers builds."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from verl_hpc.models.tiny import hf_config

    config = hf_config("llama", layers=2)
    model = get_peft_model(AutoModelForCausalLM.from_config(config),
                           LoraConfig(r=4, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                           "up_proj", "down_proj"]))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    folder = tmp_path / "tiny"
    config.save_pretrained(folder)
    arch = fsdp_plan_arch(str(folder))
    targets = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
    assert fsdp_plan.peft_layer_params(arch, 4, targets) * arch.num_layers == trainable


def test_sequence_parallelism_divides_activations_and_logits_by_sp():
    """fsdp.sp = 4 on 8 ranks: each rank holds a quarter of every sequence's tokens, so a quarter
    of the activations and logits of the same micro-batch; states and gathered units unchanged.
    (The whole logits, model.logits_chunk_tokens = 0: in chunks, a quarter of the tokens may fit
    one chunk and keep the whole-logits path, which the plan counts as such.)"""
    whole = "model.logits_chunk_tokens=0"
    one, four = plan(*FSDP, *OFFLOAD_OFF, whole), plan(*FSDP, *OFFLOAD_OFF, whole, "fsdp.sp=4")
    a, b = one.table["update_actor"], four.table["update_actor"]
    assert b["activations"] == pytest.approx(a["activations"] / 4, rel=0.01)
    assert b["logits"] == pytest.approx(a["logits"] / 4, rel=0.01)
    assert b["actor"] == a["actor"] and b["gathered"] == a["gathered"]
    assert any("fsdp.sp = 4: each sequence split over 4 ranks (Ulysses)" in n and "2 data-parallel" in n
               for n in four.notes)
