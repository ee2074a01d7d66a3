"""The SFT and DPO programs' run() in this process (one gloo rank, the tiny model) end the way the
launchers and tests read them (trainer/programs/base.py): <name>_summary.json, one <NAME>_RESULT line
without the history, the metrics file, the HF folder."""
import json
import types

import pytest
import torch

pytestmark = pytest.mark.unit

ROWS = [("1+2=", "3", "4"), ("2+2=", "4", "5"), ("3+4=", "7", "8"), ("5+1=", "6", "7")]


def _run(program, tmp_path, tiny_model, capsys, *overrides):
    from verl_hpc.config import load_config

    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"prompt": p, "response": r, "chosen": r, "rejected": w}) + "\n"
                            for p, r, w in ROWS))
    cfg = load_config(None, [f"model.path={tiny_model}", "model.dtype=float32", f"data.sft_files=[{rows}]",
                             f"data.preference_files=[{rows}]", "data.train_batch_size=2", "trainer.total_steps=2",
                             "actor.micro_batch_size=2", "tracking.backends=[jsonl]",
                             f"trainer.output_dir={tmp_path}/out", *overrides])
    ctx = types.SimpleNamespace(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo",
                                generator=torch.Generator().manual_seed(0),
                                preemption=types.SimpleNamespace(agreed=lambda: False))
    summary = program(cfg, ctx)
    name = cfg.trainer.job
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith(f"{name.upper()}_RESULT ")]
    assert len(lines) == 1
    shown = json.loads(lines[0].split(" ", 1)[1])
    written = json.loads((tmp_path / "out" / f"{name}_summary.json").read_text())
    assert (tmp_path / "out" / "metrics.jsonl").exists() and (tmp_path / "out" / "hf" / "model.safetensors").exists()
    return summary, shown, written


def test_sft_program(one_rank_world, tmp_path, tiny_model, capsys):
    from verl_hpc.trainer.programs import sft

    summary, shown, written = _run(sft.run, tmp_path, tiny_model, capsys, "trainer.job=sft")
    # every program's loop (trainer/programs/base.py): the same keys as RL's and DPO's around its own
    assert list(written) == ["steps", "stopped", "rows", "total_steps", "hf_dir", "resumed_from", "restarts", "history",
                             "seconds", "plot", "metrics_file", "first_loss", "last_loss", "host_peak_gib_per_rank"]
    assert written["steps"] == 2 and written["rows"] == 4 and written["stopped"] == "completed"
    assert [list(h) for h in written["history"]] == [["sft/loss"]] * 2
    assert shown == {k: v for k, v in written.items() if k != "history"}


def test_sft_with_lora_writes_the_merged_model(one_rank_world, tmp_path, tiny_model, capsys):
    """SFT of adapters (lora.rank > 0): the HF folder it writes is the base with the adapter merged
    in, so the adapted weights moved and nothing else did (the base is frozen)."""
    from safetensors.torch import load_file

    from verl_hpc.trainer.programs import sft

    _, _, written = _run(sft.run, tmp_path, tiny_model, capsys, "trainer.job=sft", "lora.rank=4",
                         "lora.target_modules=[linear_qkv]", "actor.optim.lr=1e-2")
    base = load_file(f"{tiny_model}/model.safetensors")
    out = load_file(str(tmp_path / "out" / "hf" / "model.safetensors"))
    moved = {n for n in base if not torch.equal(base[n], out[n])}
    assert moved and all(n.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight")) for n in moved), moved
    assert written["last_loss"] < written["first_loss"]
    # the adapter itself, as a PEFT folder: peft puts it on the base and gives the merged model
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    ids = torch.tensor([[3, 17, 42, 99, 7]])
    with torch.no_grad():
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "out" / "hf")(input_ids=ids).logits
        base_model = AutoModelForCausalLM.from_pretrained(tiny_model)
        adapted = PeftModel.from_pretrained(base_model, tmp_path / "out" / "hf" / "adapter")(input_ids=ids).logits
    torch.testing.assert_close(adapted, merged, atol=1e-5, rtol=1e-5)


def test_sft_program_trains_multi_turn_demonstrations(one_rank_world, tmp_path, tiny_model, capsys):
    """Rows whose response is a list of messages (tool-use demonstrations) train through the same
    program; a malformed one is a DataError naming the file and row."""
    from verl_hpc.config import load_config
    from verl_hpc.data import DataError
    from verl_hpc.data.prepare.tool_arith import demonstration
    from verl_hpc.trainer.programs import sft

    rows = tmp_path / "demos.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"{a}*{b}=", "response": demonstration(a, b)}) + "\n"
                            for a, b in ((12345, 67890), (11111, 22222), (31415, 92653), (27182, 81828))))
    summary, _, written = _run(sft.run, tmp_path, tiny_model, capsys, "trainer.job=sft", f"data.sft_files=[{rows}]",
                               "data.max_response_length=128")
    assert written["rows"] == 4 and written["steps"] == 2 and written["last_loss"] < written["first_loss"]
    rows.write_text(json.dumps({"prompt": "1*2=", "response": [{"role": "tool", "content": "2"}]}) + "\n")
    cfg = load_config(None, [f"model.path={tiny_model}", f"data.sft_files=[{rows}]", "trainer.job=sft"])
    with pytest.raises(DataError, match=r"demos.jsonl' row 0: field 'response': a multi-turn response starts"):
        sft.load_sft_rows(cfg, sft.load_tokenizer(cfg))


def test_dpo_program(one_rank_world, tmp_path, tiny_model, capsys):
    from verl_hpc.trainer.programs import preference

    summary, shown, written = _run(preference.run, tmp_path, tiny_model, capsys, "trainer.job=dpo")
    assert written["steps"] == 2 and written["stopped"] == "completed" and len(written["history"]) == 2
    assert "history" not in shown and shown == {k: v for k, v in written.items() if k != "history"}


def test_dpo_with_lora_has_the_base_as_its_reference(one_rank_world, tmp_path, tiny_model, capsys):
    """DPO of adapters: the reference is the actor with its adapters off. The first step's policy
    equals it (a fresh adapter), so the loss is ln 2; after that the policy moved and the reference
    did not (a reference that kept the adapters on would stay at ln 2 forever)."""
    import math

    from verl_hpc.trainer.programs import preference

    _, _, written = _run(preference.run, tmp_path, tiny_model, capsys, "trainer.job=dpo", "lora.rank=4",
                         "actor.optim.lr=5e-2", "trainer.total_steps=3")
    losses = [row["preference/loss"] for row in written["history"]]
    assert losses[0] == pytest.approx(math.log(2), abs=1e-6)
    assert abs(losses[-1] - math.log(2)) > 1e-4, losses


def test_missing_tracking_package_is_a_config_error(monkeypatch):
    """A backend whose package is missing ends the rank with one line naming the field (exit 2)."""
    import types

    from verl_hpc.config import ConfigError
    from verl_hpc.runtime.errors import exit_code_for
    from verl_hpc.trainer.programs import base as program

    monkeypatch.setattr(program, "missing_packages", lambda backends: ["wandb"])
    cfg = types.SimpleNamespace(tracking=types.SimpleNamespace(backends=["console", "wandb"]))
    with pytest.raises(ConfigError, match="tracking.backends needs packages that are not installed: wandb") as e:
        program.check_tracking(cfg)
    assert exit_code_for(e.value) == 2
