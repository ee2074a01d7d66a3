"""DPO learns, KTO learns: on the synthetic preference task (chosen = the sum, rejected = the sum
plus one, the SFT warm start's systematic mistake), 12 steps of 32 examples from the shared SFT warm
start (the one the RL learning tests use) take the held-out preference accuracy from 0.5 (policy =
reference: every margin is 0, ties count 1/2) to >= 0.9, and the policy's greedy accuracy on the
100 validation prompts (transformers' generate on the exported HF folder, independent of the
engines) rises by more than 10 points. One job per loss, in the test process, gives both figures (1 rank).
Measured here: DPO 0.50 -> 0.95 and 37% -> 56%, KTO 0.50 -> 0.96 and 37% -> 51%
(about 1 s of training each; the warm start is the same bits in every session, tests/jobs.py)."""
import pytest

from jobs import data_overrides, logs, run_here
from verl_hpc.config import JobConfig

STEPS = 12
GREEDY_GAIN = 0.10
# greedy_eval's CLI settings: 4 new tokens, the default data section's prompt column and wrapping
GREEDY = dict(max_new_tokens=4, prompt_key=JobConfig().data.prompt_key,
              wrap_plain_text=JobConfig().data.wrap_plain_text)


@pytest.fixture
def warm(warm_assets):
    return warm_assets  # the shared SFT warm start under sft/hf


@pytest.fixture(scope="module")
def greedy_before(warm_assets):
    from verl_hpc.trainer.greedy_eval import greedy_accuracy

    return greedy_accuracy(str(warm_assets / "sft" / "hf"), str(warm_assets / "data" / "val.parquet"), **GREEDY)


@pytest.mark.parametrize("loss,train_file", [("dpo", "preference_train"), ("kto", "kto_train")])
def test_trn_preference_training_learns(warm, greedy_before, tmp_path, loss, train_file):
    from verl_hpc.trainer.greedy_eval import greedy_accuracy

    out = tmp_path / loss
    proc, s = run_here("configs/demo_dpo.yaml", out, f"model.path={warm}/sft/hf", *data_overrides(warm),
                       f"algorithm.preference.loss={loss}",
                       f"data.preference_files=[{warm}/data/{train_file}.parquet]",
                       f"data.preference_val_files=[{warm}/data/preference_val.parquet]",
                       f"trainer.total_steps={STEPS}", "trainer.val_every=0", "tracking.backends=[jsonl]",
                       "tracking.plots=false")
    assert proc.returncode == 0, logs(proc, out)
    greedy_after = greedy_accuracy(str(out / "hf"), str(warm / "data" / "val.parquet"), **GREEDY)
    print(f"{loss}: held-out preference accuracy {s['val_accuracy_before']:.2f} -> {s['val_accuracy_after']:.2f}, "
          f"greedy accuracy {greedy_before:.2f} -> {greedy_after:.2f}, {s['seconds']} s of training")
    assert s["steps"] == STEPS and s["val_rows"] == 100
    assert s["val_accuracy_before"] == pytest.approx(0.5, abs=0.05)
    assert s["val_accuracy_after"] >= 0.9, s
    assert greedy_after >= greedy_before + GREEDY_GAIN, (greedy_before, greedy_after)
