"""LoRA on 4 real gloo ranks: forward and one update at TP1 (DP4), TP2, PP2, PP2 with 2 virtual
stages (llama) and TP2 x PP2 equal Hugging Face peft's (float64 forward, fp32 update) and each
other. One launch runs every layout (lora_ranks.py). The update's reference is peft with the A of
q/k/v (gate/up) tied into one parameter as in Megatron's fused layers, the same PPO loss
(test_eng_parity's), gradient clipping over the adapters and AdamW with eps = 1 (so a weight
difference measures the gradient). A stock PEFT adapter (its own A per q/k/v, gate/up module:
`llama_stock`, at TP 1 and TP 2) against peft as it is, untied."""
import pytest
import torch

from lora_ranks import CASES, MODELS, STOCK, launch
from lora_reference import HF_TARGETS, peft_model, random_adapter, save_peft
from test_eng_parity import ACTOR, MODELS as MODEL_SHAPES, OPTIM, _actor_loss, _batch, _hf_response_logprobs

pytestmark = pytest.mark.no_vllm("LoRA parity of the training engines: no rollout")

WORLD = 4
LORA = dict(rank=4, alpha=8.0)
LOGP_TOL, WEIGHT_TOL = 2e-5, 1e-5


def _reference(folder, adapter, batch, cfg, tie_a=True):
    from peft import get_peft_model_state_dict, set_peft_model_state_dict

    targets = tuple(HF_TARGETS)
    m64 = peft_model(folder, LORA["rank"], LORA["alpha"], targets, tie_a=tie_a)
    set_peft_model_state_dict(m64, {k: v.double() for k, v in adapter.items()})
    with torch.no_grad():
        logp64, ent64, mask = _hf_response_logprobs(m64(input_ids=batch["input_ids"]).logits, batch)
    g = torch.Generator().manual_seed(11)
    batch["advantages"] = torch.randn(mask.shape, generator=g) * mask
    batch["old_log_probs"] = (logp64.float() + 0.1 * torch.randn(mask.shape, generator=g)) * mask
    batch["ref_log_probs"] = (logp64.float() + 0.05 * torch.randn(mask.shape, generator=g)) * mask
    m = peft_model(folder, LORA["rank"], LORA["alpha"], targets, dtype=torch.float32, tie_a=tie_a)
    set_peft_model_state_dict(m, adapter)
    params = [p for p in m.parameters() if p.requires_grad]
    logp, ent, mask = _hf_response_logprobs(m(input_ids=batch["input_ids"]).logits, batch)
    _actor_loss(logp, ent, mask, batch, cfg).backward()
    torch.nn.utils.clip_grad_norm_(params, OPTIM["clip_grad"])
    torch.optim.AdamW(params, lr=OPTIM["lr"], eps=OPTIM["eps"], weight_decay=0.0).step()
    updated = {k: v.detach().clone() for k, v in get_peft_model_state_dict(m).items()}
    return {"logp": logp64, "entropy": ent64, "mask": mask, "updated": updated}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from verl_hpc.models.tiny import make_tiny_model

    root = tmp_path_factory.mktemp("lora_parity")
    folders = {name: make_tiny_model(root / name, **MODEL_SHAPES[name]) for name in MODELS}
    data, refs = {}, {}
    for i, (name, folder) in enumerate(sorted(folders.items())):
        adapter = random_adapter(folder, LORA["rank"], LORA["alpha"], seed=7 + i)
        batch = _batch(300 + i, groups=(3, 3, 2) if name == "llama" else None)
        refs[name] = _reference(folder, adapter, batch, ACTOR[name])
        data[f"batch.{name}"], data[f"adapter.{name}"] = batch, adapter
    work = root / "work"
    work.mkdir()
    from safetensors.torch import load_file

    stock = save_peft(folders["llama"], work / STOCK, LORA["rank"], LORA["alpha"], seed=21)
    adapter = load_file(str(stock / "adapter_model.safetensors"))
    batch = _batch(310, groups=(3, 3, 2))
    refs[STOCK] = _reference(folders["llama"], adapter, batch, ACTOR["llama"], tie_a=False)
    data[f"batch.{STOCK}"], data[f"adapter.{STOCK}"] = batch, adapter
    torch.save(data, work / "batch.pt")
    args = dict(models={k: str(v) for k, v in folders.items()}, optim=OPTIM, actor={**ACTOR, STOCK: ACTOR["llama"]},
                lora=LORA, micro_batch_size=2, total_steps=10)
    ranks = launch(WORLD, args, work)
    return {"ranks": ranks, "refs": refs, "work": work,
            "adapters": {m: data[f"adapter.{m}"] for m in (*MODELS, STOCK)}}


def _load(run, name):
    return torch.load(run["work"] / f"{name}.pt")


@pytest.mark.parametrize("layout, model", CASES)
def test_lora_forward_equals_peft(run, layout, model):
    out, ref = _load(run, f"{layout}.forward.{model}"), run["refs"][model]
    for key, expected in (("log_probs", ref["logp"]), ("entropy", ref["entropy"])):
        assert float((out[key].double() - expected).abs().max()) <= LOGP_TOL, key


@pytest.mark.parametrize("layout, model", CASES)
def test_lora_update_equals_peft_and_tp1(run, layout, model):
    got, ref, start = _load(run, f"{layout}.update.{model}"), run["refs"][model]["updated"], run["adapters"][model]
    assert sorted(got) == sorted(ref)
    moved = max(float((ref[k] - start[k]).abs().max()) for k in ref)
    assert moved > 100 * WEIGHT_TOL, "the update must move the adapters visibly"
    assert max(float((got[k] - ref[k]).abs().max()) for k in ref) <= WEIGHT_TOL
    tp1 = _load(run, f"tp1.update.{model}")
    assert max(float((got[k] - tp1[k]).abs().max()) for k in ref) <= WEIGHT_TOL
    checks = run["ranks"][0]["layouts"][layout]["checks"][f"lora.{model}"]
    assert checks["version"] == 1
