"""The Megatron engine on 4 real gloo ranks against transformers and against itself.

One launch of 4 ranks runs every layout in turn (data parallelism fills what a layout leaves):

    layout       ranks           checks
    tp1          DP4             actor (forward, fixed + dynamic update), PRIME's PRM, roles,
                                 non-finite step, zero-advantage rows skipped
    tp2          TP2 x DP2       actor, PRM
    pp2          PP2 x DP2       actor, PRM, zero-advantage rows skipped
    pp2vpp2      PP2 x DP2, 2 virtual stages per rank (interleaved schedule)   actor (llama)
    tp2pp2       TP2 x PP2       actor, roles, export -> transformers logits, state save
    tp1_resume   DP4             state load (written at tp2pp2 with the distributed optimizer)
                                 into the plain optimizer, then the next step

References computed here with transformers: float64 log-probs/entropy of the response tokens, the
same actor loss (PPO clip + KL loss + entropy bonus) and one AdamW step with gradient clipping.
Adam's eps is 1 so that the first step is SGD-like (lr * g / (|g| + 1)): a comparison of weights
then measures gradients, where eps=1e-8 would make it sign(g) and amplify rounding noise.
"""
import pytest
import torch

from eng_ranks import ACTOR_LAYOUTS, PRM_BETA, PRM_LAYOUTS, launch

pytestmark = pytest.mark.no_vllm("parity of the training engine across layouts: no rollout")


WORLD = 4
LOGP_TOL = 2e-5  # fp32 Megatron vs float64 transformers
WEIGHT_TOL = 1e-5
# llama's batch: 3 prompts with 3, 3 and 2 responses; its actor engines pack them where the
# layout allows (eng_ranks.check_actor), so micro-batches of 2 (fixed) and of a token budget
# (dynamic) mix packed and plain rows. qwen2's batch has 8 different prompts.
PROMPT_GROUPS = {"llama": (3, 3, 2)}
MODELS = {"llama": dict(family="llama", layers=4, seed=0),
          "qwen2_tied": dict(family="qwen2", tied=True, layers=2, seed=2)}
OPTIM = dict(lr=0.5, eps=1.0, clip_grad=1.0, weight_decay=0.0)
ACTOR = {"llama": dict(entropy_coeff=0.01, use_kl_loss=True, kl_loss_coef=0.1,
                       loss_agg_mode="token-mean", ppo_mini_batch_size=8),
         "qwen2_tied": dict(entropy_coeff=0.0, use_kl_loss=True, kl_loss_coef=0.1,
                            loss_agg_mode="seq-mean-token-mean", ppo_mini_batch_size=8)}


def _batch(seed, n=8, groups=None):
    """n random sequences; with `groups` (sizes summing to n) consecutive samples share a prompt,
    as GRPO's n responses to one prompt do (the engine may then pack them: prefix.py)."""
    from verl_hpc.engines.batch import pack_sequences

    g = torch.Generator().manual_seed(seed)
    plen = torch.randint(2, 9, (n,), generator=g)
    rlen = torch.randint(1, 11, (n,), generator=g)
    prompts = [torch.randint(5, 480, (int(p),), generator=g).tolist() for p in plen]
    if groups:
        assert sum(groups) == n
        first = [i for i, size in enumerate(groups) for _ in range(size)]
        starts = [sum(groups[:i]) for i in range(len(groups))]
        prompts = [prompts[starts[k]] for k in first]
    resps = [torch.randint(5, 480, (int(r),), generator=g).tolist() for r in rlen]
    return pack_sequences(prompts, resps)


def _hf_response_logprobs(logits, batch):
    """log p(response token t) from logits at p + t - 1, and entropy there, [B, T] (zero-padded)."""
    from verl_hpc.engines.batch import get_response_mask, response_positions, response_tokens

    mask = get_response_mask(batch)
    pos = response_positions(batch["prompt_lengths"], mask.shape[1], batch["input_ids"].shape[1])
    rows = logits[torch.arange(len(pos)).unsqueeze(1), pos]
    logp_all = torch.log_softmax(rows, dim=-1)
    tok = response_tokens(batch["input_ids"], batch["prompt_lengths"], mask.shape[1])
    logp = logp_all.gather(-1, tok.unsqueeze(-1)).squeeze(-1)
    ent = -(logp_all.exp() * logp_all).sum(-1)
    return logp * mask, ent * mask, mask


def _actor_loss(logp, ent, mask, batch, cfg):
    """The loss of verl_hpc.algorithms.PolicyObjective (what Actor.update runs), on the whole batch at once."""
    from verl_hpc.algorithms import agg_loss, compute_policy_loss, kl_loss
    from verl_hpc.config.schema import ActorConfig

    a = ActorConfig(**cfg)  # the clip ranges the engines' actor gets (eng_ranks._actor_cfg)
    loss, _ = compute_policy_loss("vanilla", batch["old_log_probs"], logp, batch["advantages"], mask,
                                  clip_ratio_low=a.clip_ratio_low, clip_ratio_high=a.clip_ratio_high,
                                  clip_ratio_c=a.clip_ratio_c, loss_agg_mode=cfg["loss_agg_mode"])
    loss = loss - cfg["entropy_coeff"] * agg_loss(ent, mask, cfg["loss_agg_mode"])
    kl, _ = kl_loss(logp, batch["ref_log_probs"], mask, cfg["kl_loss_coef"], "low_var_kl",
                    loss_agg_mode=cfg["loss_agg_mode"])
    return loss + kl


def _references(folder, batch, cfg, batch2=None):
    """float64 forward outputs and the transformers weights after one actor update."""
    from transformers import AutoModelForCausalLM

    hf64 = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64)
    with torch.no_grad():
        logp64, ent64, mask = _hf_response_logprobs(hf64(batch["input_ids"]).logits, batch)
    g = torch.Generator().manual_seed(11)
    batch["advantages"] = torch.randn(mask.shape, generator=g) * mask
    batch["old_log_probs"] = (logp64.float() + 0.1 * torch.randn(mask.shape, generator=g)) * mask
    batch["ref_log_probs"] = (logp64.float() + 0.05 * torch.randn(mask.shape, generator=g)) * mask
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    logp, ent, mask = _hf_response_logprobs(hf(batch["input_ids"]).logits, batch)
    _actor_loss(logp, ent, mask, batch, cfg).backward()
    torch.nn.utils.clip_grad_norm_(hf.parameters(), OPTIM["clip_grad"])
    torch.optim.AdamW(hf.parameters(), lr=OPTIM["lr"], eps=OPTIM["eps"], weight_decay=0.0).step()
    updated = {n: p.detach().clone() for n, p in hf.state_dict().items()}
    if hf.config.tie_word_embeddings:
        updated.pop("lm_head.weight")
    return {"logp": logp64, "entropy": ent64, "mask": mask, "updated": updated}


def _prm_reference(folder, batch):
    """The implicit PRM's update in transformers: the CE of sigmoid(beta * summed log-ratio to
    batch["ref_log_probs"]) against eng_ranks.check_prm's labels, written out by hand, then the
    same AdamW step as the actor's reference."""
    from transformers import AutoModelForCausalLM

    labels = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0, 0.0])
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    logp, _, mask = _hf_response_logprobs(hf(batch["input_ids"]).logits, batch)
    score = PRM_BETA * ((logp - batch["ref_log_probs"]) * mask).sum(-1)
    loss = (labels * torch.nn.functional.softplus(-score) + (1 - labels) * torch.nn.functional.softplus(score)).mean()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(hf.parameters(), OPTIM["clip_grad"])
    torch.optim.AdamW(hf.parameters(), lr=OPTIM["lr"], eps=OPTIM["eps"], weight_decay=0.0).step()
    return {n: p.detach().clone() for n, p in hf.state_dict().items()}


def _reward_model(src, out):
    """A LlamaForSequenceClassification folder (backbone of `src` + a random score head)."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from verl_hpc.models.tiny import save_safetensors

    out.mkdir(parents=True)
    cfg = AutoConfig.from_pretrained(src)
    cfg.architectures, cfg.num_labels = ["LlamaForSequenceClassification"], 1
    cfg.save_pretrained(out)
    state = {k: v for k, v in load_file(str(src / "model.safetensors")).items() if k != "lm_head.weight"}
    state["score.weight"] = 0.3 * torch.randn(1, cfg.hidden_size, generator=torch.Generator().manual_seed(5))
    save_safetensors(state, out)
    return out


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from verl_hpc.models.tiny import make_tiny_model

    assert {m for _, m in ACTOR_LAYOUTS} == set(MODELS), "eng_ranks.ACTOR_LAYOUTS names the models built here"
    root = tmp_path_factory.mktemp("eng_parity")
    folders = {name: make_tiny_model(root / name, **kw) for name, kw in MODELS.items()}
    folders["reward"] = _reward_model(folders["llama"], root / "reward")
    data, refs = {}, {}
    for i, (name, folder) in enumerate(sorted(folders.items())):
        if name == "reward":
            continue
        batch = _batch(100 + i, groups=PROMPT_GROUPS.get(name))
        refs[name] = _references(folder, batch, ACTOR[name])
        data[f"batch.{name}"] = batch
    refs["prm"] = _prm_reference(folders["llama"], data["batch.llama"])
    b2 = _batch(200)
    b2["advantages"] = torch.randn(b2["input_ids"].shape[0], int(b2["response_lengths"].max()),
                                   generator=torch.Generator().manual_seed(3))
    b2["old_log_probs"] = torch.zeros_like(b2["advantages"]) - 5.0
    b2["ref_log_probs"] = torch.zeros_like(b2["advantages"]) - 5.0
    data["batch2.llama"] = b2
    work = root / "work"
    work.mkdir()
    torch.save(data, work / "batch.pt")
    args = dict(models={k: str(v) for k, v in folders.items()}, optim=OPTIM, actor=ACTOR,
                micro_batch_size=2, max_tokens=30, total_steps=10,
                state_optim=dict(OPTIM, lr=0.05, eps=1e-3, lr_decay_style="linear", min_lr=0.01))
    ranks = launch(WORLD, args, work)
    return {"ranks": ranks, "refs": refs, "work": work, "folders": folders, "data": data}


def _load(run, name):
    return torch.load(run["work"] / f"{name}.pt")


def _max_diff(a: dict, b: dict) -> float:
    assert sorted(a) == sorted(b)
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.mark.parametrize("layout, model", ACTOR_LAYOUTS)
def test_forward_logprobs_and_entropy_equal_float64_reference(run, layout, model):
    out, ref = _load(run, f"{layout}.forward.{model}"), run["refs"][model]
    mask = ref["mask"]
    for key, expected in (("log_probs", ref["logp"]), ("entropy", ref["entropy"])):
        got = out[key].double()
        assert got.shape == expected.shape
        assert float((got - expected).abs().max()) <= LOGP_TOL, key
        assert bool((got[mask == 0] == 0).all()), f"{key}: padding must be zero"


@pytest.mark.parametrize("layout, model", ACTOR_LAYOUTS)
def test_actor_update_equals_transformers_and_tp1(run, layout, model):
    got, ref = _load(run, f"{layout}.fixed.{model}"), run["refs"][model]["updated"]
    from safetensors.torch import load_file

    start = load_file(str(run["folders"][model] / "model.safetensors"))
    moved = max(float((ref[k] - start[k]).abs().max()) for k in ref)
    assert moved > 100 * WEIGHT_TOL, "the update must move the weights visibly"
    assert _max_diff(got, ref) <= WEIGHT_TOL
    assert _max_diff(got, _load(run, f"tp1.fixed.{model}")) <= WEIGHT_TOL


@pytest.mark.parametrize("layout, model", ACTOR_LAYOUTS)
def test_dynamic_batching_equals_fixed_micro_batches(run, layout, model):
    fixed, dynamic = _load(run, f"{layout}.fixed.{model}"), _load(run, f"{layout}.dynamic.{model}")
    assert _max_diff(fixed, dynamic) <= WEIGHT_TOL
    checks = run["ranks"][0]["layouts"][layout]["checks"][f"actor.{model}"]
    assert abs(checks["fixed"]["actor/loss"] - checks["dynamic"]["actor/loss"]) <= 1e-5


def test_shared_prompts_were_packed_where_the_layout_allows(run):
    """The llama checks above ran packed micro-batches (not vacuous), except with virtual
    pipeline stages, which need fixed shapes."""
    for lay, m in ACTOR_LAYOUTS:
        for kind in ("fixed", "dynamic"):
            packed = sum(r["layouts"][lay]["checks"][f"actor.{m}"][kind]["actor/packed_microbatches"]
                         for r in run["ranks"])
            if m == "llama" and lay != "pp2vpp2":
                assert packed > 0, (lay, kind)
            else:
                assert packed == 0, (lay, m, kind)


def test_distributed_optimizer_only_where_there_is_data_parallelism(run):
    """use_distributed_optimizer=True builds Megatron's DistributedOptimizer where data parallelism
    has ranks to shard over, and the plain optimizer at dp 1 (the parity checks above hold for both)."""
    for lay, m in ACTOR_LAYOUTS:
        rec = run["ranks"][0]["layouts"][lay]
        kinds = set(rec["checks"][f"actor.{m}"]["optimizers"])
        assert kinds == ({"DistributedOptimizer"} if rec["dp"] > 1 else {"FP32Optimizer"}), (lay, m, kinds)
    assert {run["ranks"][0]["layouts"][lay]["dp"] for lay, _ in ACTOR_LAYOUTS} >= {1, 2}


def test_dynamic_batching_changes_the_split(run):
    """The comparison above is not vacuous: the token budget gave other micro-batch counts."""
    counts = {(lay, m, kind): run["ranks"][0]["layouts"][lay]["checks"][f"actor.{m}"][kind]["actor/num_microbatches"]
              for lay, m in ACTOR_LAYOUTS for kind in ("fixed", "dynamic")}
    assert any(counts[(lay, m, "fixed")] != counts[(lay, m, "dynamic")] for lay, m in ACTOR_LAYOUTS)


def test_export_after_step_reproduces_engine_logits_in_transformers(run):
    from transformers import AutoConfig, AutoModelForCausalLM

    exported = _load(run, "tp2pp2.fixed.llama")
    hf = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(run["folders"]["llama"]),
                                          dtype=torch.float32)
    missing, unexpected = hf.load_state_dict(exported, strict=False)
    assert not unexpected and not missing
    engine_logits = _load(run, "tp2pp2.logits.llama")
    with torch.no_grad():
        hf_logits = hf(run["data"]["batch.llama"]["input_ids"]).logits
    assert engine_logits.shape == hf_logits.shape
    assert float((engine_logits - hf_logits).abs().max()) <= 1e-4


@pytest.mark.parametrize("layout", PRM_LAYOUTS)
def test_prm_forward_and_update_equal_transformers_and_tp1(run, layout):
    """PRIME's implicit PRM at DP4, TP2 and PP2: its log-probs are the float64 reference's, and
    its CE update lands where the hand-written loss in transformers does, and where DP4's does."""
    fwd = _load(run, f"{layout}.prm_forward.llama")["prm_log_probs"].double()
    assert float((fwd - run["refs"]["llama"]["logp"]).abs().max()) <= LOGP_TOL
    got, ref = _load(run, f"{layout}.prm_update.llama"), run["refs"]["prm"]
    from safetensors.torch import load_file

    start = load_file(str(run["folders"]["llama"] / "model.safetensors"))
    assert max(float((ref[k] - start[k]).abs().max()) for k in ref) > 100 * WEIGHT_TOL, "the update must move"
    assert _max_diff(got, ref) <= WEIGHT_TOL
    assert _max_diff(got, _load(run, "tp1.prm_update.llama")) <= WEIGHT_TOL
    m = run["ranks"][0]["layouts"][layout]["checks"]["prm"]
    assert m["prm/nonfinite_steps"] == 0 and m["prm/ce_loss"] > 0 and m["prm/packed_microbatches"] > 0


@pytest.mark.parametrize("layout", ["tp1", "tp2pp2"])
def test_critic_reference_and_reward_roles(run, layout):
    res = run["ranks"][0]["layouts"][layout]["checks"]["roles"]
    batch = run["data"]["batch.llama"]
    mask = run["refs"]["llama"]["mask"]
    critic = _load(run, f"{layout}.critic.llama")
    assert critic["before"].shape == mask.shape and torch.isfinite(critic["before"]).all()
    assert bool((critic["before"][mask == 0] == 0).all())
    assert torch.isfinite(critic["after"]).all() and not torch.equal(critic["before"], critic["after"])
    upd = res["critic_update"]
    assert upd["critic/nonfinite_steps"] == 0 and upd["critic/vf_loss"] > 0
    assert res["critic_export_names"][-1] == "score.weight"
    tp1 = _load(run, "tp1.critic.llama")
    assert float((critic["before"] - tp1["before"]).abs().max()) <= 1e-5
    assert float((critic["after"] - tp1["after"]).abs().max()) <= 1e-5

    assert not res["ref_requires_grad"] and not res["ref_optimizer"] and not res["ref_grads"]
    assert "frozen" in res["ref_train_error"]
    ref_logp = _load(run, f"{layout}.ref.llama")["ref_log_probs"]
    assert float((ref_logp - _load(run, f"{layout}.forward.llama")["log_probs"]).abs().max()) <= 1e-6

    from transformers import AutoModelForSequenceClassification

    scores = _load(run, f"{layout}.reward.reward")
    hf = AutoModelForSequenceClassification.from_pretrained(run["folders"]["reward"], dtype=torch.float32)
    with torch.no_grad():
        expected = hf(batch["input_ids"]).logits.squeeze(-1)  # pooled at the last non-pad token
    assert scores["rm_scores"].shape == (batch["input_ids"].shape[0],)
    assert float((scores["rm_scores"] - expected).abs().max()) <= 1e-4
    last = batch["response_lengths"] - 1
    rows = torch.arange(len(last))
    assert torch.equal(scores["rm_token_scores"][rows, last], scores["rm_scores"])
    assert int((scores["rm_token_scores"] != 0).sum()) == len(last)


@pytest.mark.parametrize("layout", ["tp1", "tp2pp2"])
def test_sdpa_core_attention_equals_megatron_local_attention(run, layout):
    sdpa, local = _load(run, f"{layout}.forward.llama"), _load(run, f"{layout}.local_attention.llama")
    for key in ("log_probs", "entropy"):
        assert float((sdpa[key] - local[key]).abs().max()) <= 1e-5, key


def test_nonfinite_loss_is_reported_and_skipped(run):
    res = run["ranks"][0]["layouts"]["tp1"]["checks"]["nonfinite"]
    assert res["metrics"]["actor/nonfinite_steps"] == 1.0
    assert res["unchanged"], "a non-finite step must leave the weights as they were"
    assert res["then"]["actor/nonfinite_steps"] == 0.0
    assert all(v == v for v in res["then"].values())  # no nan afterwards


@pytest.mark.parametrize("layout", ["tp1", "pp2"])
def test_skipped_zero_advantage_rows_leave_the_update_as_it_was(run, layout):
    """Rows with all-zero advantages left out (actor.skip_zero_advantage_rows) while data-parallel
    ranks get no row, and in an update where every row has zero advantages: every rank still
    steps (no hang), and the weights equal the full updates'."""
    for r in run["ranks"]:
        res = r["layouts"][layout]["checks"]["zero_adv"]
        assert res["max_diff"] <= WEIGHT_TOL, (r["rank"], res["max_diff"])
        assert res["moved_by_second"] > 100 * WEIGHT_TOL, "the all-zero update must move the weights (Adam)"
        assert [m["actor/zero_adv_skipped_share"] for m in res["skip"]] == [5 / 8, 7 / 8]
        assert [m["actor/zero_adv_skipped_share"] for m in res["full"]] == [0.0, 0.0]
        assert all(m["actor/nonfinite_steps"] == 0.0 for m in res["skip"] + res["full"])


def test_state_saved_at_tp2pp2_resumes_at_tp1(run):
    saved = run["ranks"][0]["layouts"]["tp2pp2"]["checks"]["state_save"]
    loaded = run["ranks"][0]["layouts"]["tp1_resume"]["checks"]["state_load"]
    all_saved = sorted({n for r in run["ranks"] for n in r["layouts"]["tp2pp2"]["checks"]["state_save"]["names"]})
    all_loaded = sorted({n for r in run["ranks"] for n in r["layouts"]["tp1_resume"]["checks"]["state_load"]["names"]})
    assert all_saved == all_loaded
    assert any(n.endswith("linear_fc1.weight/gate") for n in all_saved)
    assert any(n.startswith("optim/exp_avg_sq/") for n in all_saved)
    assert not loaded["nan_targets"], "every slab the loader asked for was written"
    assert saved["meta"]["optimizer_step"] == 1 and saved["meta"]["scheduler"]["num_steps"] == 1
    # linear decay 0.05 -> 0.01 over 10 trainer steps: the LR each update used, and after loading
    assert saved["step1"]["actor/lr"] == pytest.approx(0.05)
    assert saved["step2"]["actor/lr"] == pytest.approx(0.05 - (0.05 - 0.01) * 1 / 10)
    assert loaded["lr_loaded"] == loaded["step2"]["actor/lr"] == pytest.approx(saved["step2"]["actor/lr"])
    assert loaded["step2"]["actor/loss"] == pytest.approx(saved["step2"]["actor/loss"], abs=1e-5)
    assert _max_diff(_load(run, "tp1_resume.resumed.llama"), _load(run, "tp2pp2.continued.llama")) <= WEIGHT_TOL
