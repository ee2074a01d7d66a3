"""trainer.job=dpo pieces without an engine: preference data (bad rows named, the synthetic task),
the step's row layout, and the two-pass surrogate giving the exact loss gradient whatever the
micro-batch split."""
import json

import pytest
import torch

from verl_hpc.algorithms import masked_sum
from verl_hpc.config import JobConfig
from verl_hpc.config.schema import PreferenceConfig
from verl_hpc.data.errors import DataError
from verl_hpc.data.preference import load_preference_examples
from verl_hpc.data.prepare import synthetic
from verl_hpc.trainer.programs.preference import build_batch, objective, surrogate_loss

D = JobConfig().data  # the data section's column names; raw prompts (no chat template)
KEYS = dict(prompt_key=D.prompt_key, chosen_key=D.chosen_key, rejected_key=D.rejected_key,
            completion_key=D.completion_key, label_key=D.label_key, wrap_plain_text=False)


class CharTokenizer:
    """One id per character, EOS 1; no chat template (plain prompts are used as they are)."""
    eos_token_id, pad_token_id, chat_template = 1, 0, None

    def __call__(self, texts, add_special_tokens=False):
        return {"input_ids": [[2 + ord(ch) % 50 for ch in t] for t in texts]}


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_paired_and_kto_rows_load_and_bad_rows_are_named(tmp_path):
    tok = CharTokenizer()
    f = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "1+2=", "chosen": "3", "rejected": "4"}])
    (ex,) = load_preference_examples([f], tok, "dpo", **KEYS)
    assert ex.chosen[-1] == 1 and ex.rejected[-1] == 1 and ex.chosen != ex.rejected
    bad = write_jsonl(tmp_path / "b.jsonl", [{"prompt": "1+2=", "chosen": "3", "rejected": "4"},
                                             {"prompt": "2+2=", "chosen": "4"}])
    with pytest.raises(DataError, match=r"b.jsonl' row 1: field 'rejected' is missing or empty"):
        load_preference_examples([bad], tok, "dpo", **KEYS)
    same = write_jsonl(tmp_path / "s.jsonl", [{"prompt": "1+2=", "chosen": "3", "rejected": "3"}])
    with pytest.raises(DataError, match="row 0: 'chosen' and 'rejected' are the same text"):
        load_preference_examples([same], tok, "ipo", **KEYS)
    kto = write_jsonl(tmp_path / "k.jsonl", [{"prompt": "1+2=", "completion": "3", "label": True},
                                             {"prompt": "1+3=", "completion": "5", "label": "maybe"}])
    with pytest.raises(DataError, match=r"k.jsonl' row 1: label must be a boolean"):
        load_preference_examples([kto], tok, "kto", **KEYS)


def test_synthetic_preference_task():
    rows = synthetic.preference(50, 10, seed=3)
    for r in rows["preference_train"]:
        a, b = r["extra"]["a"], r["extra"]["b"]
        assert r["prompt"] == f"{a}+{b}=" and r["chosen"] == str(a + b) and r["rejected"] == str(a + b + 1)
    kto = rows["kto_train"]
    assert all(r["completion"] == (r["ground_truth"] if r["label"] else str(int(r["ground_truth"]) + 1))
               for r in kto)
    assert 0 < sum(r["label"] for r in kto) < len(kto)


def toy_model_logps(w, batch):
    """Per-token log-probs of a toy differentiable 'model' (depends on token ids and w)."""
    ids = batch["input_ids"].float()
    width = batch["response_mask"].shape[1]
    feats = ids[:, -width:] if ids.shape[1] >= width else ids
    return torch.nn.functional.logsigmoid(w[0] * feats / 50 + w[1])


@pytest.mark.parametrize("loss", ["dpo", "ipo", "simpo", "orpo", "kto"])
def test_surrogate_gives_the_loss_gradient_for_any_micro_batch_split(loss):
    tok = CharTokenizer()
    rows = synthetic.preference(6, 2, seed=1)["preference_train"]
    from verl_hpc.data.preference import PreferenceExample
    ex = [PreferenceExample(tok([r["prompt"]])["input_ids"][0], tok([r["chosen"]])["input_ids"][0] + [1],
                            tok([r["rejected"] + "0"])["input_ids"][0] + [1], desirable=i % 2 == 0)
          for i, r in enumerate(rows)]
    batch = build_batch(ex, loss, 0)
    n = batch["input_ids"].shape[0]
    assert n == 12
    pr = PreferenceConfig(loss=loss, beta=0.5)
    w = torch.tensor([0.3, -0.2], dtype=torch.float64, requires_grad=True)
    mask = batch["response_mask"].double()
    ref = masked_sum(toy_model_logps(torch.tensor([0.1, 0.1], dtype=torch.float64), batch), mask, dim=-1)
    lengths = mask.sum(-1)
    desirable = torch.tensor([e.desirable for e in ex])
    seq = masked_sum(toy_model_logps(w, batch), mask, dim=-1)
    direct, _ = objective(pr, seq, ref, lengths, desirable)
    (g_direct,) = torch.autograd.grad(direct, w)
    s = seq.detach().clone().requires_grad_(True)
    loss_value, _ = objective(pr, s, ref, lengths, desirable)
    (coef,) = torch.autograd.grad(loss_value, s)
    total = torch.zeros(2, dtype=torch.float64)
    for rows_ in ([0, 5, 7], [1, 2, 3, 11], [4, 6, 8, 9, 10]):  # pairs split across micro-batches
        idx = torch.tensor(rows_)
        mb = {"response_mask": mask[idx], "pref_coef": coef[idx]}
        part, _ = surrogate_loss({"log_probs": toy_model_logps(w, {k: v[idx] for k, v in batch.items()
                                                                    if k != "pref_coef"})}, mb, None)
        total += torch.autograd.grad(part, w)[0]
    torch.testing.assert_close(total, g_direct)
    assert float(loss_value.detach()) == pytest.approx(float(direct.detach()))
