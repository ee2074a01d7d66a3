"""A GRPO job with Ulysses sequence parallelism (fsdp.sp = 2) through the user's command line on 2
local ranks, against the same job at sp = 1 (data-parallel 2): a tiny Llama that declares no EOS
token, so that every answer runs to the response limit of 2,048 tokens whatever it samples (with its
EOS, sampled about once in 500 tokens, a response passed 1,000 tokens one time in 7). Same seeds, so the rollouts are the same; sp = 2 gives
the first step's loss, gradient norm and entropy of sp = 1, and its update's log-probs equal the
rollout's (the regrouped attention is the model's own); the update's per-rank memory rise about
halves (benchmarks/bench_sp_memory.py measures it against the plan). The 4-rank equality of log-probs and
weights on 4,000-token rows is tests/dist/engines/test_fsdp_sp.py."""
import os

import pytest

from jobs import data_overrides, logs, metrics, run_job

JOB = ["parallel.engine=fsdp", "rollout.engine=hf", "data.max_response_length=2048", "data.train_batch_size=2",
       "rollout.n=2", "actor.ppo_mini_batch_size=2", "actor.micro_batch_size=1", "trainer.total_steps=1",
       "trainer.val_every=0", "tracking.backends=[jsonl]", "tracking.plots=false", "actor.entropy_coeff=0.01",
       "slurm.cpus_per_task=1"]
# a fixed glibc mmap threshold: freed activations leave the resident set, so the update's memory
# rise is what it held (benchmarks/bench_sp_memory.py says why)
ENV = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(128 << 10))


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """The tiny Llama with 4,096 positions and no EOS in its config.json (where the rollout reads it)."""
    import json

    from verl_hpc.models.tiny import make_tiny_model

    path = make_tiny_model(tmp_path_factory.mktemp("sp_job") / "model", "llama", layers=2, max_positions=4096)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(dict(config, eos_token_id=None), indent=2))
    return path


# a chain of two 2-rank launches with 2,048-token rollouts (about 110 s of a worker): make test-long.
# make test keeps the sequence-parallel numerics at 4 ranks (tests/dist/engines/test_fsdp_sp.py) and
# fsdp.sp's checks before the queue (tests/unit/planning, tests/unit/config)
@pytest.mark.long
def test_grpo_at_sp2_equals_sp1(tiny_assets, model, tmp_path):
    runs = {}
    for sp in (1, 2):
        out = tmp_path / f"sp{sp}"
        proc, summary = run_job("configs/demo_rl.yaml", out, f"model.path={model}", *data_overrides(tiny_assets),
                                *JOB, f"fsdp.sp={sp}", ranks=2, timeout=300, env=ENV)
        assert proc.returncode == 0 and summary["steps"] == 1, logs(proc, out)
        assert ("sequence parallel 2 (Ulysses; 1 data-parallel groups)" in logs(proc, out)) == (sp == 2)
        runs[sp] = metrics(out)[-1]
    one, two = runs[1], runs[2]
    assert one["response_length/mean"] == 2048.0, "every response runs to the limit: the test means much only then"
    assert two["response_length/mean"] == one["response_length/mean"]  # the same rollouts
    for key in ("actor/loss", "actor/grad_norm", "actor/entropy"):
        assert two[key] == pytest.approx(one[key], rel=1e-4, abs=1e-7), key
    assert two["rollout/logprob_diff_mean"] < 1e-5 and one["rollout/logprob_diff_mean"] < 1e-5
    # the rows x padded lengths the group ran (bench_scaling's all-to-all formula reads it): each of the
    # 4 one-row micro-batches padded to a multiple of sp = 2
    tokens = two["rollout/prompt_tokens"] + two["rollout/response_tokens"]
    assert tokens <= two["actor/sp_padded_tokens"] <= tokens + 4 and two["actor/sp_padded_tokens"] % 2 == 0
    assert "actor/sp_padded_tokens" not in one
    # the update's memory per rank (activations and logits of the rank's tokens) about halves: each
    # rank holds half of every row (measured 0.074 -> 0.041 GiB, 0.55; the rest is the same at both sp)
    rise = {sp: runs[sp]["mem_rise_gib/update_actor"] for sp in runs}
    assert rise[1] > 0.04 and rise[2] < 0.7 * rise[1], rise
