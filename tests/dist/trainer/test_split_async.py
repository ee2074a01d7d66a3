"""Split placement, for real: 1 rollout rank (vLLM) + 1 training rank (Megatron) on this machine.

k = 0 reproduces colocated training bitwise; k = 2 never trains on a token more than 2 versions old;
a 50-step run preempted 3 times (Slurm's warning signal) and resumed trains on exactly the prompts of
an uninterrupted run, with the batches ready and the prefixes in flight carried over in the checkpoints.
"""
import base64
import collections
import json
import math
import os
import pickle

import h5py
import pytest
import numpy as np
from faults import env
from jobs import REPO, data_overrides, run_here, run_job

SPLIT_DEMO = "configs/demo_rl_split.yaml"  # demo_rl.yaml + placement split, 1 rollout rank of 2, k = 1


def common(root, steps, prompts=4):
    return [f"model.path={root}/sft/hf", *data_overrides(root), f"trainer.total_steps={steps}", "trainer.val_every=0",
            f"data.train_batch_size={prompts}", "rollout.n=4", f"actor.ppo_mini_batch_size={prompts}",
            "actor.micro_batch_size=16",
            "rollout.engine=vllm", "slurm.cpus_per_task=1", "checkpoint.save_every=0"]


def actor_tensors(ckpt):
    with h5py.File(next(ckpt.glob("rank_*.h5")), "r") as f:
        out = {}
        f.visititems(lambda name, obj: out.__setitem__(name, np.asarray(obj)) if isinstance(obj, h5py.Dataset)
                     and "actor" in name else None)
    return out


def rows(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


def test_k0_split_gives_colocated_weights_bitwise(warm_assets, tmp_path):
    colo, split = tmp_path / "colocated", tmp_path / "split"
    # the colocated run is one rank: in this process (tests/jobs.py's run_here), no command line to start
    p1, s1 = run_here("configs/demo_rl.yaml", colo, *common(warm_assets, 3))
    assert p1.returncode == 0, p1.stdout[-3000:] + p1.stderr[-3000:]
    p2, s2 = run_job(SPLIT_DEMO, split, *common(warm_assets, 3),
                     "async_training.staleness=0", ranks=2)
    assert p2.returncode == 0, p2.stdout[-3000:] + p2.stderr[-3000:]
    a, b = actor_tensors(colo / "checkpoints" / "step_000003"), actor_tensors(split / "checkpoints" / "step_000003")
    assert a and a.keys() == b.keys()
    for name in a:
        assert np.array_equal(a[name], b[name]), name
    assert any(r.get("actor/grad_norm", 0) > 0 for r in rows(split))  # it learned: the comparison is not vacuous
    # the rollout rank took its weights over the sliced publish (one rank of inference TP 1: all of them)
    assert sum(r.get("async/weights_bytes/rollout", 0.0) for r in rows(split)) > 0
    assert [r["actor/loss"] for r in rows(colo) if "actor/loss" in r] == \
           [r["actor/loss"] for r in rows(split) if "actor/loss" in r]


# IcePop's launch is in make test-long (a second 2-rank launch of the same split k = 2 job, 50 s): make
# test keeps M2PO's, which runs the same stale-token path; IcePop's mask and loss are checked by hand in
# tests/unit/algorithms/test_alg_third_wave.py and its correction terms in tests/unit/trainer
# m2po's verdict (its mask took some stale tokens out) rests on how far 4 steps move the sampled
# tokens' log-probs: make test-portable runs it too
@pytest.mark.parametrize("loss", [pytest.param("icepop", marks=pytest.mark.long),
                                  pytest.param("m2po", marks=pytest.mark.numerics)])
def test_k2_split_trains_with_the_stale_token_losses(tiny_assets, tmp_path, loss):
    """IcePop and M2PO where their ratio matters: split placement at k = 2, so the rollout's log-probs
    are up to 2 versions behind pi_old (the trainer's recomputed proximal policy). 4 steps of the
    tiny random model on a reward with a varying component (tests/jobs/task_rewards.py): every step
    trains with finite metrics on stale tokens, the loss reports its mask, and no proximal / behaviour
    weight is put on top of IcePop's own."""
    jobs_dir = str(REPO / "tests" / "jobs")  # the custom reward's module, for the ranks
    rewards_on_path = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [jobs_dir, os.environ.get("PYTHONPATH")])))
    out = tmp_path / loss
    args = [f"model.path={tiny_assets}/model", *data_overrides(tiny_assets), "trainer.total_steps=4",
            "trainer.val_every=0", "data.train_batch_size=4", "rollout.n=4", "actor.ppo_mini_batch_size=4",
            "actor.micro_batch_size=16", "rollout.engine=vllm", "slurm.cpus_per_task=1", "checkpoint.save_every=0",
            "async_training.staleness=2", f"actor.policy_loss={loss}", "safety.allow_custom_code=true",
            "reward.custom_function=task_rewards:score_and_checksum",
            # tighter than the papers' (band [0.5, 5], tau 0.04), so that 4 steps of a tiny model show the
            # masks at work on stale tokens (measured: |log pi_old - log pi_rollout| up to 0.6, M2 up to 0.05)
            "actor.icepop_low=0.8", "actor.icepop_high=1.25", "actor.m2_threshold=0.01"]
    p, s = run_job(SPLIT_DEMO, out, *args, ranks=2, timeout=400, env=rewards_on_path)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    steps = [r for r in rows(out) if "async/staleness_max" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4] and max(r["async/staleness_max"] for r in steps) <= 2
    assert any(r["async/staleness_max"] > 0 for r in steps)  # stale tokens were trained on
    own = {"icepop": "actor/icepop_masked_frac", "m2po": "m2po/masked_frac"}[loss]
    for r in steps:
        assert all(math.isfinite(v) for v in r.values() if isinstance(v, float)), r
        assert own in r and "actor/pg_loss" in r and r["actor/grad_norm"] > 0, sorted(r)
        assert ("rollout_corr/is_weight_mean" in r) == (loss == "m2po")  # the decoupled weights: not on IcePop
    stale = [r for r in steps if r["async/staleness_max"] > 0]
    assert max(r["rollout_corr/kl_k3"] for r in stale) > 0  # the rollout's log-probs and pi_old differ there
    assert any(r[own] > 0 for r in stale)  # and the loss's mask took some stale tokens out
    if loss == "m2po":  # what stayed is inside the second-moment bound
        assert all(r["m2po/m2_kept"] <= 0.01 for r in steps)


# Slurm's warning signal after these steps, one per launch: early (the rollout's first batches in
# flight), the very step after a resume (the restored state saved again), and mid-run a step that is
# at once a periodic save (save_every=12) and a validating step (val_every=24): 4 launches in all
# (each case once; they were 5 preemptions at 3, 11, 12, 26 (save), 38 (validates) in 6 launches)
PREEMPT_AT = (3, 4, 24)
SAVE_EVERY, VAL_EVERY = 12, 24


@pytest.mark.long  # a soak run: 4 launches over 50 steps (make test-long)
@pytest.mark.timeout(1500)  # 4 launches of a 2-rank job, plus the warm start if this test builds it
def test_k2_50_steps_with_3_preemptions_train_every_prompt_once_and_keep_prefixes(warm_assets, tmp_path):
    out, samples = tmp_path / "run", tmp_path / "samples"
    # one token per chunk: every answer (a digit or two, then EOS) spans chunks, so prefixes exist
    # 8 prompts a step, not 4: at 4 the gain by step 50 was +0.14 here (+0.20 colocated), too close
    # to the bound below to hold across warm starts; at 8 it is +0.28 for the same run time
    args = [*common(warm_assets, 50, prompts=8), "async_training.staleness=2", "async_training.chunk_tokens=1",
            f"checkpoint.save_every={SAVE_EVERY}", f"trainer.val_every={VAL_EVERY}",
            f"trainer.rollout_data_dir={samples}"]
    # each case of the comment above holds by construction, not by chance
    assert PREEMPT_AT[1] == PREEMPT_AT[0] + 1 and PREEMPT_AT[2] % SAVE_EVERY == 0 == PREEMPT_AT[2] % VAL_EVERY
    trained, saved = [], []
    for launch, at in enumerate((*PREEMPT_AT, 0)):
        # the test faults (tests/faults.py): Slurm's warning signal after step `at` (0: never), and
        # generation slower than training, as on GPUs. The first preemption finds sequences
        # half-generated by construction (the rollout holds mid-batch until the trainer's pause):
        # on a loaded machine the rollout may otherwise be ahead and idle at every preemption
        signal = (dict(warning_signal_mid_generation={"at": at, "dir": str(tmp_path / f"hold{launch}")},
                       rollout_holds_mid_batch=str(tmp_path / f"hold{launch}"))
                  if launch == 0 else dict(warning_signal_at_step=at))
        p, s = run_job(SPLIT_DEMO, out, *args, ranks=2, timeout=600, env=env(rollout_chunk_delay_s=0.3, **signal))
        assert p.returncode == (140 if at else 0), p.stdout[-3000:] + p.stderr[-3000:]  # 128 + SIGUSR2
        assert s["resumed_from"] == (PREEMPT_AT[launch - 1] if launch else 0), s
        assert launch or (tmp_path / "hold0" / "was_held").exists()
        assert (s["stopped"] == "completed") == (not at) and s["steps"] == (at or 50), s
        trained += s["trained_prompt_ids"]
        if at:  # read now: checkpoint.keep_last removes old checkpoints
            saved.append(_split_state(out / "checkpoints" / f"step_{at:06d}"))

    # every trained token within k = 2 versions of the trainer's, over all 50 steps; nothing dropped
    steps = [r for r in rows(out) if "async/staleness_max" in r]
    assert [r["step"] for r in steps] == list(range(1, 51))
    assert max(r["async/staleness_max"] for r in steps) <= 2
    assert any(r["async/staleness_max"] > 0 for r in steps)  # it did run ahead: the bound is not vacuous
    assert all(r["async/dropped_groups"] == 0 for r in steps)
    val = {r["step"]: r["val/acc/all"] for r in rows(out) if "val/acc/all" in r}
    assert sorted(val) == [0, 24, 48, 50], val  # the preempted step 24 validated before it stopped
    assert val[50] >= val[0] + 0.15, val  # and it learned (0.34 -> 0.62 measured, colocated 0.34 -> 0.59)

    # the prompts of an uninterrupted run (nothing dropped: batch s of the data stream at step s), none
    # skipped or repeated across the 3 requeues
    stream = _data_stream(warm_assets, args, 50)
    assert collections.Counter(trained) == collections.Counter(stream)
    assert trained == stream

    # what was in flight or ready at each preemption is what the resumed run trained on: ready
    # batches whole, unfinished samples continued from their saved prefixes (tokens and versions)
    prefixes = 0
    for blob in saved:
        for rec in blob["ready"]:
            dumped = _dumped(samples, rec.index)
            for r, i in enumerate(rec.groups.result.prompt_index):
                key = (rec.groups.prompts.ids[i], rec.groups.result.sample_index[r])
                assert dumped[key]["response_ids"] == rec.groups.result.response_ids[r], key
        batch = blob["rollout"]["inflight"]
        if batch is not None:
            dumped = _dumped(samples, batch.index)
            for i, row in enumerate(batch.samples):
                for j, sample in enumerate(row):
                    got = dumped[(batch.prompts.ids[i], j)]
                    assert got["response_ids"][:len(sample.tokens)] == sample.tokens, (batch.index, i, j)
                    assert got["versions"][:len(sample.versions)] == sample.versions, (batch.index, i, j)
                    prefixes += len(sample.tokens) if sample.finish is None else 0
    assert prefixes > 0  # some preemption did catch sequences half-generated


def _dumped(folder, step):
    lines = [json.loads(x) for x in (folder / f"step_{step:06d}.jsonl").read_text().splitlines()]
    return {(x["id"], x["sample"]): x for x in lines}


def _data_stream(root, overrides, steps):
    """The prompt ids of the first `steps` batches of the job's data stream (PromptLoader, in this process)."""
    from verl_hpc.config import load_config
    from verl_hpc.data import PromptLoader
    from verl_hpc.trainer.roles import load_tokenizer

    cfg = load_config(REPO / SPLIT_DEMO, overrides)
    loader = PromptLoader.from_config(cfg.data, load_tokenizer(cfg), cfg.data.wrap_plain_text)
    return [i for _ in range(steps) for i in loader.next_batch().ids]


def _split_state(ckpt):
    from verl_hpc.checkpoint.load import open_checkpoint

    with open_checkpoint(ckpt) as reader:
        loader = reader.metadata["trainer_state"]["loader"]
    return pickle.loads(base64.b64decode(loader["split_async"]))
