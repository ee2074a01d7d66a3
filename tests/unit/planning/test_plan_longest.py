"""`python -m verl_hpc.plan CONFIG --longest` (verl_hpc/planning/longest.py): the bisection's
premise (the plan's peak never falls as the response grows), the boundary it finds (checked with
plan_job on freshly loaded configs), longer responses with the sequence split over more ranks, the
layouts the rules refuse left out, and the command line."""
from pathlib import Path

import pytest

from verl_hpc.config import load_config
from verl_hpc.planning import plan_job
from verl_hpc.planning.longest import longest
from verl_hpc.plan import main

CONFIGS = Path(__file__).resolve().parents[3] / "configs"
GRPO_8B, MOE = str(CONFIGS / "grpo_8b.yaml"), str(CONFIGS / "grpo_30b_a3b.yaml")
# The whole logits (model.logits_chunk_tokens = 0): the premises below need a layout that memory
# binds, and with the output layer in chunks the 8B's update fits up to its 131072 positions
WHOLE = ["model.logits_chunk_tokens=0"]
LONG_8B = ["model.path=/path/to/Llama-3.1-8B-Instruct"] + WHOLE  # 131072 positions: memory binds, not the model
FSDP = ["parallel.engine=fsdp", "parallel.tp=1", "parallel.sequence_parallel=false",
        "parallel.recompute_granularity=none", "fsdp.activation_checkpointing=true"]


def _plan(config, overrides, response):
    return plan_job(load_config(config, overrides + [f"data.max_response_length={response}"]))


@pytest.mark.parametrize("extra", [[], ["parallel.cp=2"], FSDP, FSDP + ["fsdp.sp=2"]],
                         ids=["cp1", "cp2", "fsdp", "fsdp-sp2"])
def test_the_peak_never_falls_as_the_response_grows(extra):
    """Above the token budget (16384 tokens, a row of 15360 + the 1024-token prompt) the peak grows
    with the length; below it, no length's peak exceeds the one at the budget (dynamic batching
    packs shorter rows up to it), which is why --longest judges shorter lengths there."""
    at_budget = _plan(GRPO_8B, LONG_8B + extra, 15360).peak
    below = [_plan(GRPO_8B, LONG_8B + extra, n).peak for n in (512, 3000, 7168, 7169, 15359)]
    assert max(below) <= at_budget
    above = [_plan(GRPO_8B, LONG_8B + extra, n).peak for n in (15360, 15361, 20000, 32768, 65536, 100000)]
    assert all(a <= b for a, b in zip(above, above[1:])), above
    assert above[-1] > above[0]


def test_the_bisection_finds_the_boundary():
    """The 30B MoE config's own layout: its longest response fits, 1024 tokens more does not, and
    the exact boundary is one token (checked on configs loaded afresh, not the module's copies)."""
    row = next(r for r in longest(load_config(MOE, WHOLE)).rows if r.own)
    assert 4096 < row.longest < 40960 - 1024  # memory binds, below the model's positions
    assert row.shown % 1024 == 0 and row.shown <= row.longest < row.shown + 1024
    assert _plan(MOE, WHOLE, row.shown).fits() and not _plan(MOE, WHOLE, row.shown + 1024).fits()
    assert _plan(MOE, WHOLE, row.longest).fits() and not _plan(MOE, WHOLE, row.longest + 1).fits()
    assert row.binds == _plan(MOE, WHOLE, row.longest + 1).peak_phase == "update_actor"
    # with headroom kept the boundary moves down, and is again exact
    kept = next(r for r in longest(load_config(MOE, WHOLE), margin=0.10).rows if r.own)
    assert kept.longest < row.longest
    assert _plan(MOE, WHOLE, kept.longest).fits(0.10) and not _plan(MOE, WHOLE, kept.longest + 1).fits(0.10)
    # the output layer in chunks (the default) frees the logits' share: a longer boundary
    chunked = next(r for r in longest(load_config(MOE)).rows if r.own)
    assert chunked.longest > row.longest


@pytest.mark.parametrize("extra, field", [([], "parallel.cp"), (FSDP, "fsdp.sp")], ids=["megatron", "fsdp"])
def test_splitting_the_sequence_over_more_ranks_trains_longer_responses(extra, field):
    result = longest(load_config(GRPO_8B, LONG_8B + extra))
    rows = {(r.overrides[0] if r.overrides else f"{field}=1"): r for r in result.rows}
    base = rows[f"{field}=1"]
    assert base.own and 0 < base.longest and base.binds == "update_actor"
    assert base.longest < rows[f"{field}=2"].longest < rows[f"{field}=4"].longest
    for r in result.rows:  # each row's answer is the plan's: it fits there, with the split it names
        assert _plan(GRPO_8B, LONG_8B + extra + r.overrides, r.shown).fits(), r


def test_a_split_the_rules_refuse_is_not_listed():
    """grpo_8b: 8 ranks at tp 2 hold cp 1, 2 or 4, not 8; the FSDP engine on Qwen2.5-7B (28 heads)
    takes sp 2 and 4, not 8 (Ulysses' head rule)."""
    mega = longest(load_config(GRPO_8B))
    assert [r.label.split(" dp")[0] for r in mega.rows] == ["tp 2 pp 1 cp 1", "tp 2 pp 1 cp 2", "tp 2 pp 1 cp 4"]
    assert [label for label, _ in mega.refused] == ["parallel.cp = 8"]
    assert "valid parallel.cp: 1, 2, 4" in mega.refused[0][1]
    qwen = longest(load_config(GRPO_8B, ["model.path=/path/to/Qwen2.5-7B-Instruct"] + FSDP))
    assert [r.label.split(" (")[0] for r in qwen.rows] == ["fsdp sp 1", "fsdp sp 2", "fsdp sp 4"]
    assert qwen.refused == [("fsdp.sp = 8", "fsdp.sp = 8 must divide the model's 28 attention heads (Ulysses "
                                            "gives each rank heads/sp of them); valid: a divisor of 28")]


def test_a_layout_that_fits_at_no_length_says_so(capsys):
    """On 24 GB GPUs the 8B's states do not fit at any length: the row says so (the peak at the
    shortest length, which is that of the token budget's micro-batch)."""
    r = longest(load_config(GRPO_8B), gpu_memory_gb=24).rows[0]
    assert r.longest == 0 and r.peak > 24e9
    assert r.binds == f"{r.peak_phase} (at a micro-batch of the 16384-token budget, max_tokens_per_microbatch)"
    assert main([GRPO_8B, "--longest", "--gpu-memory-gb", "24"]) == 0
    assert "does not fit" in capsys.readouterr().out


def test_the_command_prints_the_table(capsys):
    assert main([MOE, "--longest"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].startswith("--longest: the longest data.max_response_length each layout fits in 79.6 GiB")
    rows = {r.label: r for r in longest(load_config(MOE)).rows}
    for label, r in rows.items():
        line = next(ln for ln in lines if ln.strip().startswith(label))
        assert f" {r.shown} " in line and r.binds in line
    assert "update_actor" in out and "max_position_embeddings 40960" in out
    assert "parallel.cp=2 data.max_response_length=" in out  # the command of a split row


@pytest.mark.parametrize("args, words", [
    (["--longest", "--suggest"], "--longest with --suggest: one search at a time"),
    (["--headroom", "0.1"], "--headroom without --longest"),
    (["--longest", "--headroom", "1.5"], "--headroom: got 1.5; valid: a fraction"),
])
def test_bad_combinations_are_one_line_errors(capsys, args, words):
    assert main([MOE, *args]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and words in err, err


@pytest.mark.parametrize("name, chunked_cp1", [("ppo_70b_64k.yaml", 0), ("grpo_30b_a3b_40k.yaml", 39936)])
def test_the_long_response_configs_need_their_context_parallelism(name, chunked_cp1):
    """Their own layout (cp 2) fits their response length with the shipped 10% headroom; with the
    whole logits the same GPUs at cp 1 fit no length with the same micro-batch budget (one full
    row). With the output layer in chunks (the default; context parallelism keeps the whole
    logits), the 30B MoE's cp 1 fits its whole length too: its logits were what bound it; the 70B's
    critic update still binds at cp 1."""
    chunked = {r.label.split(" dp")[0].split()[-1]: r
               for r in longest(load_config(str(CONFIGS / name)), margin=0.10).rows}
    assert chunked["1"].longest == chunked_cp1
    cfg = load_config(str(CONFIGS / name), WHOLE)
    rows = {r.label.split(" dp")[0].split()[-1]: r for r in longest(cfg, margin=0.10).rows}
    assert rows["2"].own and rows["2"].longest >= cfg.data.max_response_length
    seq = cfg.data.max_prompt_length + cfg.data.max_response_length
    assert rows["1"].longest == 0 and f"the {seq}-token budget" in rows["1"].binds
