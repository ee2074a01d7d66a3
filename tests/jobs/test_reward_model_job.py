"""reward.reward_model through the user's entry point (one rank in this process, tests/jobs.py):
a GRPO job scored by a sequence-classification scorer next to the task's rule, and by a generative
judge on HF generate; both resume bitwise (the reward model is not in the checkpoint, only its
folder's fingerprint); a judge that never gives a parseable verdict stops the job in one line. And
the judge's vLLM engine once, against transformers."""
import math

import pytest
import torch

from jobs import metrics, read_all, run_here, small, stable_metrics, straight_and_resumed


@pytest.fixture(scope="module")
def reward_models(tiny_assets, tmp_path_factory):
    from verl_hpc.models.tiny_reward import make_tiny_classifier

    root = tmp_path_factory.mktemp("rms")
    return {"scorer": make_tiny_classifier(tiny_assets / "model", root / "scorer", seed=11),
            "judge": tiny_assets / "model"}  # the policy's own start as a (poor) judge: it only has to run


SCORER = ["reward.reward_model.enable=true", "reward.reward_model.kind=scorer", "reward.reward_model.weight=0.5",
          "reward.reward_model.normalize=batch"]


def _judge(path, *extra):
    return ["reward.reward_model.enable=true", "reward.reward_model.kind=judge", f"reward.reward_model.path={path}",
            "reward.reward_model.judge.engine=hf", *extra]


def _yes_no(tiny_assets):
    """Two words that are one token each for the tiny tokenizer (the judge's yes and no)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_assets / "model")
    words = [w for w in (" yes", " no", "yes", "no", " a", " b", "a", "b", "1", "0")
             if len(tok.encode(w, add_special_tokens=False)) == 1]
    return [f"reward.reward_model.judge.yes_token='{words[0]}'", f"reward.reward_model.judge.no_token='{words[1]}'"]


def _run(tiny_assets, out, *extra):
    return run_here("configs/demo_rl.yaml", out, *small(tiny_assets, "algorithm.recipe=grpo", "rollout.n=2", *extra))


def _resumes_bitwise(tiny_assets, tmp_path, *extra):
    straight, split, _ = straight_and_resumed(lambda out, *more: _run(tiny_assets, out, *extra, *more), tmp_path,
                                              "trainer.total_steps=2")
    a, b = read_all(straight / "checkpoints"), read_all(split / "checkpoints")
    assert sorted(a) == sorted(b) and not any(n.startswith("reward") for n in a)  # frozen: not saved
    assert [n for n in a if not torch.equal(a[n], b[n])] == []
    assert stable_metrics(straight) == stable_metrics(split)
    from verl_hpc.checkpoint import read_metadata

    return read_metadata(split / "checkpoints")["trainer_state"]["reward_model"], metrics(straight)


def test_scorer_job_combines_with_the_rule_and_resumes_bitwise(tiny_assets, reward_models, tmp_path):
    record, rows = _resumes_bitwise(tiny_assets, tmp_path, *SCORER,
                                    f"reward.reward_model.path={reward_models['scorer']}")
    rows = [r for r in rows if r.get("step", 0) >= 1]
    assert len(rows) == 2
    for r in rows:
        assert math.isfinite(r["reward/rm/mean"]) and r["reward/rm/mean"] != 0
        assert "reward/rule/mean" in r
    assert record["kind"] == "scorer" and record["path"] == str(reward_models["scorer"])
    assert len(record["fingerprint"]) == 64


def test_judge_job_logs_its_verdicts_and_resumes_bitwise(tiny_assets, reward_models, tmp_path):
    record, rows = _resumes_bitwise(tiny_assets, tmp_path, *_judge(reward_models["judge"]), *_yes_no(tiny_assets))
    rows = [r for r in rows if r.get("step", 0) >= 1]
    for r in rows:
        assert r["judge/verdict_rate"] == 1.0 and r["judge/parse_failures"] == 0
        assert 0.0 <= r["judge/agreement"] <= 1.0 and r["judge/latency_s"] > 0
        assert 0.0 < r["reward/rm/mean"] < 1.0  # P(yes) / (P(yes) + P(no))
    assert record["kind"] == "judge" and record["failures_total"] == 0


def test_a_judge_whose_engine_fails_is_rebuilt_and_the_run_ends_as_without_it(tiny_assets, reward_models, tmp_path,
                                                                               monkeypatch):
    """VERL_HPC_FAULT=judge:0:2:raise: the judge's engine raises in step 2's call, is built again
    from its folder, and the chunk asked again: the run ends with the fault-free run's weights."""
    args = (*_judge(reward_models["judge"]), *_yes_no(tiny_assets), "trainer.total_steps=2")
    proc, _ = _run(tiny_assets, tmp_path / "straight", *args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    monkeypatch.setenv("VERL_HPC_FAULT", "judge:0:2:raise")
    monkeypatch.delenv("VERL_HPC_ATTEMPT", raising=False)
    faulted, _ = _run(tiny_assets, tmp_path / "faulted", *args)
    assert faulted.returncode == 0, faulted.stderr[-3000:]
    rows = [r for r in metrics(tmp_path / "faulted") if "judge/engine_restarts" in r]
    assert [(r["step"], r["judge/engine_restarts"]) for r in rows] == [(1, 0.0), (2, 1.0)], rows
    a, b = read_all(tmp_path / "straight" / "checkpoints"), read_all(tmp_path / "faulted" / "checkpoints")
    assert sorted(a) == sorted(b) and [n for n in a if not torch.equal(a[n], b[n])] == []  # bitwise
    drop = lambda rows: [{k: v for k, v in r.items() if k != "judge/engine_restarts"} for r in rows]  # noqa: E731
    assert drop(stable_metrics(tmp_path / "straight")) == drop(stable_metrics(tmp_path / "faulted"))


def test_a_judge_that_never_gives_a_verdict_stops_the_job_in_one_line(tiny_assets, reward_models, tmp_path):
    proc, _ = _run(tiny_assets, tmp_path / "out", *_judge(reward_models["judge"], "reward.reward_model.judge.verdict=pattern",
                                                          "reward.reward_model.judge.max_tokens=3",
                                                          r"reward.reward_model.judge.pattern='VERDICT=(\d)'"),
                   "trainer.total_steps=1")
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode != 0 and len(errors) == 1, proc.stderr[-3000:]
    assert "the judge failed on 8 of 8 responses" in errors[0] and "max_failure_share" in errors[0]
    assert "Traceback" not in proc.stderr


def test_real_vllm_engine_gives_the_verdicts_transformers_gives(tmp_path):
    """The judge's second in-process vLLM engine (CPU here): greedy texts and next-token log-probs
    as HF's float32 forward gives them. In this tier for the engine's start-up (20-50 s on CPU)."""
    from verl_hpc.models.tiny import make_tiny_model
    from verl_hpc.rollout.hf.judge import HFJudgeEngine
    from verl_hpc.rollout.vllm.judge import VllmJudgeEngine

    folder = make_tiny_model(tmp_path / "judge", "llama", layers=2, seed=3)
    hf = HFJudgeEngine(str(folder))
    prompts = ["one plus one = two", "two = three is the answer", "x"]
    top = torch.log_softmax(hf.model(**hf._encode(prompts[:1])).logits[0, -1].float(), -1).topk(2).indices.tolist()
    want_lp, want_text = hf.next_token_logprobs(prompts, top), hf.generate(prompts, 5)
    eng = VllmJudgeEngine(str(folder), max_model_len=128, gpu_memory_utilization=0.2)
    try:
        got_lp, got_text = eng.next_token_logprobs(prompts, top), eng.generate(prompts, 5)
    finally:
        eng.close()
    assert got_text == want_text
    assert all(math.isfinite(v) for v in got_lp[0])  # the first prompt's top 2: among vLLM's top 20
    for g_row, w_row in zip(got_lp, want_lp):
        for g, w in zip(g_row, w_row):
            assert g == -math.inf or abs(g - w) < 1e-3, (g, w)
