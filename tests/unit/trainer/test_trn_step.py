"""`RLTrainer.step` with fake roles (no ranks, no vLLM, no Megatron): the order of the stages and
the data each stage hands the next. The fakes record every call; the real pieces between them
(prompt loader, reward rules, advantage estimators, objectives, weight sync) run as in a job."""
import dataclasses
import json
import types

import pytest
import torch

from faults import SHIFT_WHY, injected
from verl_hpc.algorithms import PolicyObjective, ValueObjective, compute_advantages
from verl_hpc.config import load_config
from verl_hpc.engines.batch import as_engine_batch
from verl_hpc.rollout import RolloutResult
from verl_hpc.tracking import StageTimer
from verl_hpc.trainer.programs.rl import RLTrainer
from verl_hpc.trainer.roles import Roles


PROMPTS = {"1+2=": "3", "2+2=": "4"}


class CharTokenizer:
    """One token per character (ids = code points); no chat template: prompts are used raw."""
    pad_token_id, eos_token_id, chat_template = 0, 1, None

    def __call__(self, texts, add_special_tokens=True):
        return {"input_ids": [[ord(c) for c in t] for t in texts]}

    def batch_decode(self, ids, skip_special_tokens=True):
        return ["".join(chr(i) for i in row if i > 1) for row in ids]


class FakeRollout:
    """Answers each prompt right in sample 0 and wrong (answer + 1) in the others."""

    def __init__(self, calls):
        self.calls, self.loaded = calls, {}

    def generate(self, prompt_ids, spec, media=None):
        self.calls.append("rollout.generate")
        texts = ["".join(map(chr, p)) for p in prompt_ids]
        rows = [(i, j) for i in range(len(texts)) for j in range(spec.n)]
        answers = [str(int(PROMPTS[texts[i]]) + (j > 0)) for i, j in rows]
        return RolloutResult(prompts=[list(p) for p in prompt_ids], prompt_index=[i for i, _ in rows],
                             sample_index=[j for _, j in rows], response_ids=[[ord(c) for c in a] for a in answers],
                             logprobs=[[-0.5] * len(a) for a in answers], finish_reason=["stop"] * len(rows),
                             seconds=0.1)

    weights_dropped = False  # a rollout without sleep mode keeps its weights

    def __getattr__(self, method):  # sleep, wake, close: recorded, nothing else to do
        if method not in ("sleep", "wake", "close"):
            raise AttributeError(method)
        return lambda tags=None: self.calls.append(f"rollout.{method}")

    def load_weights(self, weights):
        self.calls.append("rollout.load_weights")
        self.loaded.update(dict(weights))


class FakeEngine:
    def export_hf_weights(self):
        yield "model.w", torch.full((2, 2), 7.0)


class FakeRole:
    """Records (name.method, batch) and answers with tensors shaped like the response mask."""

    def __init__(self, name, calls, seen):
        self.name, self.calls, self.seen, self.engine = name, calls, seen, FakeEngine()

    def _record(self, method, batch, loss=None):
        self.calls.append(f"{self.name}.{method}")
        self.seen[f"{self.name}.{method}"] = (as_engine_batch(batch), loss)
        return as_engine_batch(batch)["response_mask"]

    def log_probs(self, batch):
        mask = self._record("log_probs", batch)
        if self.name == "actor":
            return {"old_log_probs": -0.4 * mask, "entropy": 2.0 * mask}
        if self.name == "prm":  # PRIME's implicit PRM: 0.1 above the reference on every token
            return {"prm_log_probs": -0.5 * mask}
        return {"ref_log_probs": -0.6 * mask}

    def values(self, batch):
        return {"values": 0.25 * self._record("values", batch)}

    def update(self, batch, loss):
        self._record("update", batch, loss)
        return {f"{self.name}/nonfinite_steps": 0.0}


def _trainer(tmp_path, *overrides):
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "data_source": "synthetic_arith", "ground_truth": a})
                            + "\n" for p, a in PROMPTS.items()))
    cfg = load_config(None, [f"data.train_files=[{data}]", "data.train_batch_size=2", "data.shuffle=false",
                             "trainer.val_every=0", f"trainer.output_dir={tmp_path}/out",
                             "rollout.engine=hf", *overrides])
    calls, seen = [], {}
    roles = Roles(CharTokenizer(), FakeRole("actor", calls, seen), FakeRollout(calls),
                  ref=FakeRole("ref", calls, seen) if cfg.ref.enable else None,
                  critic=FakeRole("critic", calls, seen) if cfg.critic.enable else None,
                  prm=FakeRole("prm", calls, seen) if cfg.prm.enable else None)
    ctx = types.SimpleNamespace(rank=0, world_size=1, generator=torch.Generator().manual_seed(0),
                                preemption=types.SimpleNamespace(agreed=lambda: False))
    return RLTrainer(cfg, ctx, roles=roles), calls, seen


def test_trn_step_runs_the_stages_in_order(tmp_path):
    trainer, calls, seen = _trainer(tmp_path, "algorithm.recipe=ppo", "rollout.n=2")
    timer = StageTimer()
    m = trainer.step(1, timer)
    # the weights are stale at the start of a run: wake them, sync, wake the KV cache, generate;
    # after the update they are stale again, synced before the next generation (not now)
    assert calls == ["rollout.wake", "rollout.load_weights", "rollout.wake", "rollout.generate", "rollout.sleep",
                     "actor.log_probs", "ref.log_probs", "critic.values", "critic.update", "actor.update"]
    assert list(timer.pop())[:-1] == [f"timing_s/{s}" for s in (
        "wake", "sync", "wake_kv", "generate", "reward", "old_logprob", "ref", "values", "adv", "update_critic",
        "update_actor")]
    # what each stage was handed: the forward roles see the sequences only, the updates the
    # fields the earlier stages filled
    assert set(seen["actor.log_probs"][0]) == {"input_ids", "prompt_lengths", "response_lengths",
                                               "response_mask"}
    critic_batch, critic_loss = seen["critic.update"]
    assert {"old_log_probs", "ref_log_probs", "values", "advantages", "returns"} <= set(critic_batch)
    assert critic_loss == ValueObjective.from_config(trainer.cfg.critic)
    assert trainer.roles.rollout.loaded["model.w"].eq(7.0).all()  # the actor's export reached it
    assert m["reward/kl"] == pytest.approx(0.2)  # old - ref = 0.2 per token, KL in the reward
    assert m["actor/entropy"] == pytest.approx(2.0) and m["sync/tensors"] == 1.0
    assert m["train/samples"] == 4.0


def test_trn_step_advantages_from_the_rewards_reach_the_actor_update(tmp_path):
    trainer, calls, seen = _trainer(tmp_path, "algorithm.recipe=grpo", "rollout.n=2", "actor.old_log_probs=forward")
    m = trainer.step(1, StageTimer())
    assert "critic.values" not in calls  # GRPO: no critic; its KL loss needs the reference
    batch, loss = seen["actor.update"]
    torch.testing.assert_close(batch["ref_log_probs"], -0.6 * batch["response_mask"])
    mask = batch["response_mask"]
    assert mask.tolist() == [[1.0], [1.0], [1.0], [1.0]]  # one-token answers: 3, 4 right; 4, 5 wrong
    scores = torch.tensor([1.0, 0.0, 1.0, 0.0]).unsqueeze(1)  # the rule's reward on the last token
    want, _ = compute_advantages("grpo", scores, mask, group_ids=torch.tensor([0, 0, 1, 1]),
                                 norm_adv_by_std=trainer.cfg.algorithm.norm_adv_by_std)
    torch.testing.assert_close(batch["advantages"], want)
    assert batch["advantages"][0, 0] > 0 > batch["advantages"][1, 0]
    torch.testing.assert_close(batch["old_log_probs"], -0.4 * mask)  # the actor's forward, passed on
    assert loss == PolicyObjective.from_config(trainer.cfg.actor) and loss.policy_loss == "vanilla"
    assert m["reward/score/mean"] == pytest.approx(0.5)
    assert m["rollout/logprob_diff_max"] == pytest.approx(0.1)  # rollout -0.5 vs actor -0.4


def _shortcut_trainer(tmp_path, *overrides):
    return _trainer(tmp_path, "algorithm.recipe=grpo", "rollout.n=2", "actor.ppo_mini_batch_size=2", *overrides)


def test_trn_on_policy_step_takes_old_log_probs_from_the_update(tmp_path, caplog):
    """One mini-batch, one epoch: no separate actor forward; the update gets the shortcut's
    objective and the rollout log-probs (for the mismatch metric), and the log says which path."""
    trainer, calls, seen = _shortcut_trainer(tmp_path)
    timer = StageTimer()
    with caplog.at_level("INFO", logger="verl_hpc.trainer.programs.rl"):
        m = trainer.step(1, timer)
        trainer.step(2, StageTimer())
    assert "actor.log_probs" not in calls and "timing_s/old_logprob" not in timer.pop()
    batch, loss = seen["actor.update"]
    assert "old_log_probs" not in batch and loss.old_from_update
    assert loss == dataclasses.replace(PolicyObjective.from_config(trainer.cfg.actor), old_from_update=True)
    torch.testing.assert_close(batch["rollout_log_probs"], -0.5 * batch["response_mask"])
    said = [r.getMessage() for r in caplog.records if "old log-probs" in r.getMessage()]
    assert said == ["old log-probs: taken from the actor update's own forward (no separate pass) "
                    "(one mini-batch, one epoch: on-policy)"]  # once, not every step
    assert "rollout/logprob_diff_max" not in m


@pytest.mark.parametrize("override, faults, why", [
    ("actor.old_log_probs=forward", {}, "actor.old_log_probs=forward"),
    ("actor.ppo_epochs=2", {}, "actor.ppo_epochs=2"),
    ("actor.ppo_mini_batch_size=1", {}, "4 sequences > one mini-batch of 2"),
    ("algorithm.rollout_correction.rollout_is=token", {}, "rollout_is/rollout_rs"),
    (None, {"rollout_logprob_shift": 0.0}, SHIFT_WHY),  # the test fault (tests/faults.py) reads pi_old too
])
def test_trn_separate_old_forward_runs_when_the_config_needs_it(tmp_path, override, faults, why, caplog):
    extra = [override] if override else []
    extra += ["data.train_batch_size=2"] if "mini_batch_size=1" in str(override) else []
    trainer, calls, seen = _shortcut_trainer(tmp_path, *extra)
    with caplog.at_level("INFO", logger="verl_hpc.trainer.programs.rl"), injected(**faults):
        trainer.step(1, StageTimer())
    assert "actor.log_probs" in calls
    batch, loss = seen["actor.update"]
    assert not loss.old_from_update
    torch.testing.assert_close(batch["old_log_probs"], -0.4 * batch["response_mask"])
    assert any("a separate actor forward" in r.getMessage() and why in r.getMessage() for r in caplog.records)


def test_trn_kl_in_reward_with_a_reference_needs_the_separate_forward(tmp_path):
    trainer, calls, _ = _shortcut_trainer(tmp_path, "algorithm.use_kl_in_reward=true",
                                          "algorithm.kl_ctrl.kl_coef=0.1")
    trainer.step(1, StageTimer())
    assert calls.index("actor.log_probs") < calls.index("ref.log_probs") < calls.index("actor.update")


def test_trn_kl_coefficient_zero_builds_no_reference(tmp_path):
    """GRPO's KL loss at coefficient 0 changes nothing: no reference role, no reference forward."""
    trainer, calls, seen = _shortcut_trainer(tmp_path, "actor.kl_loss_coef=0.0")
    assert trainer.cfg.actor.use_kl_loss and not trainer.cfg.ref.enable
    trainer.step(1, StageTimer())
    assert not any(c.startswith("ref.") for c in calls)
    batch, loss = seen["actor.update"]
    assert "ref_log_probs" not in batch
