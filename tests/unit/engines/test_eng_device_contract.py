"""The device contract of the engines (the first GPU run: the Megatron model stayed on the CPU
and no CPU test could see it, because on CPU every device is the CPU). Here the accelerator is
stood in for by torch's `meta` device where a placement decision is under test: a module that
is not moved ends on the CPU, which the test then sees."""
import pytest
import torch

from verl_hpc.runtime import device as device_mod


def test_build_gpt_model_moves_every_parameter_and_buffer_to_the_compute_device(one_rank_world, monkeypatch):
    """Megatron places its own parameters on the GPU (use_cpu_initialization=False) but not what
    torch builds itself (its torch-norm fallback without apex): the builder moves the whole model,
    as Megatron-LM's get_model does. `meta` stands in for the GPU."""
    from verl_hpc.models import gpt as gpt_mod
    from verl_hpc.models.config_mapping import parse_hf_config
    from verl_hpc.parallel import init_model_parallel

    init_model_parallel(1, 1)
    arch = parse_hf_config({"architectures": ["LlamaForCausalLM"], "vocab_size": 256, "hidden_size": 64,
                            "intermediate_size": 128, "num_hidden_layers": 2,
                            "num_attention_heads": 4, "num_key_value_heads": 2})
    monkeypatch.setattr(gpt_mod, "compute_device", lambda: torch.device("meta"))
    model = gpt_mod.build_gpt_model(arch)
    tensors = dict(model.named_parameters()) | dict(model.named_buffers())
    assert tensors and all(t.device.type == "meta" for t in tensors.values()), \
        [n for n, t in tensors.items() if t.device.type != "meta"]


def test_misplaced_tensors_names_what_stayed_behind():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.LayerNorm(2))
    assert device_mod.misplaced_tensors([model], torch.device("cpu")) == []
    model[1].to("meta")
    assert device_mod.misplaced_tensors([model], torch.device("cpu")) == ["1.weight (meta)", "1.bias (meta)"]
    model[1].register_buffer("table", torch.zeros(1))  # a buffer built later, on the CPU
    assert device_mod.misplaced_tensors([model], torch.device("meta")) == ["0.weight (cpu)", "0.bias (cpu)",
                                                                           "1.table (cpu)"]


def test_place_on_device_moves_modules_and_returns_the_device(monkeypatch):
    monkeypatch.setattr(device_mod, "compute_device", lambda: torch.device("meta"))
    modules = [torch.nn.Linear(2, 2), torch.nn.Embedding(3, 2)]
    assert device_mod.place_on_device(modules, "test") == torch.device("meta")
    assert all(p.device.type == "meta" for m in modules for p in m.parameters())


@pytest.mark.parametrize("options", [dict(), dict(lora_rank=4), dict(head="value"), dict(trainable=False),
                                     dict(family="qwen3_moe")],
                         ids=["actor", "lora", "critic", "reference", "moe"])
def test_megatron_engine_roles_pass_the_device_contract(one_rank_world, tmp_path, options):
    """Actor, LoRA actor, critic (value head attached after the build) and a frozen role (reference,
    teacher, reward model): everything on the engine's device once built; the engine checks it
    itself (place_on_device)."""
    from verl_hpc.config.sections.lora import LoraConfig
    from verl_hpc.engines.megatron import MegatronEngine, default_options
    from verl_hpc.models.tiny import make_tiny_model
    from verl_hpc.parallel import init_model_parallel

    model = make_tiny_model(tmp_path / "model", options.get("family", "llama"), layers=1)
    init_model_parallel(1, 1)
    kw = dict(model_path=str(model))
    if "lora_rank" in options:
        kw["lora"] = LoraConfig(rank=options["lora_rank"])
    for key in ("head", "trainable"):
        if key in options:
            kw[key] = options[key]
    engine = MegatronEngine(default_options(**kw))
    assert engine.device == device_mod.compute_device()
    assert device_mod.misplaced_tensors(engine.gpt_chunks, engine.device) == []


def test_adam_step_is_created_where_torch_would_create_it():
    """The fused (and capturable) Adam kernels take the step count on the parameter's device (the
    CUDA fused kernel refuses a CPU one at the first step after a resume: pytorch issue 124133);
    the others keep it on the CPU. `meta` stands in for the GPU."""
    from verl_hpc.engines.megatron.state import adam_step_tensor, ensure_optimizer_state

    p = torch.nn.Parameter(torch.zeros(3, device="meta"))
    assert adam_step_tensor({"fused": True}, p).device.type == "meta"
    assert adam_step_tensor({"capturable": True}, p).device.type == "meta"
    assert adam_step_tensor({"fused": False, "capturable": False}, p).device.type == "cpu"

    class Wrapper:  # Megatron's chained optimizer as ensure_optimizer_state reads it
        def __init__(self, inner):
            self.optimizer, self.init_state_fn, self.config = inner, None, None

    inner = torch.optim.AdamW([p], fused=False)
    inner.param_groups[0]["fused"] = True  # the engine's use_fused_torch_adam does this on CPU and GPU
    ensure_optimizer_state(type("Chained", (), {"chained_optimizers": [Wrapper(inner)]})())
    assert inner.state[p]["step"].device.type == "meta"


def test_fused_adamw_resumes_with_the_restored_step_on_cpu():
    """The fused AdamW really steps after ensure_optimizer_state + a restored step count (CPU)."""
    from verl_hpc.engines.megatron.state import ensure_optimizer_state, set_optimizer_step_count

    class Wrapper:
        def __init__(self, inner):
            self.optimizer, self.init_state_fn, self.config = inner, None, None

    p = torch.nn.Parameter(torch.ones(4))
    inner = torch.optim.AdamW([p], lr=0.1, fused=True)
    chained = type("Chained", (), {"chained_optimizers": [Wrapper(inner)]})()
    ensure_optimizer_state(chained)
    inner.state[p]["exp_avg"] = torch.zeros(4)
    inner.state[p]["exp_avg_sq"] = torch.zeros(4)
    set_optimizer_step_count(chained, 7)
    p.grad = torch.ones(4)
    inner.step()
    assert int(inner.state[p]["step"]) == 8 and torch.all(p < 1)


def test_fsdp_engine_passes_the_device_contract(one_rank_world, tmp_path):
    from verl_hpc.engines.fsdp import FsdpEngine
    from verl_hpc.engines.options import default_options
    from verl_hpc.models.tiny import make_tiny_model

    model = make_tiny_model(tmp_path / "model", "llama", layers=1)
    engine = FsdpEngine(default_options(str(model), engine="fsdp", micro_batch_size=2, total_steps=2))
    assert device_mod.misplaced_tensors([engine.model], engine.device) == []
