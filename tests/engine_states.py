"""Engines of both kinds built, updated, saved and resumed as the trainer does it, for the
checkpoint tests across engines, layouts and models (tests/dist/checkpoint/test_ckpt_cross_engine.py,
tests/unit/checkpoint/test_ckpt_fsdp_export.py, tests/unit/engines/test_eng_resume_refusals.py).

    eng = engine("fsdp", folder)                       # or "megatron" (inside init_model_parallel)
    update(eng, make_batch(7))                         # one actor update (PPO clip), one Adam step
    meta = save(eng, root, step, layout)               # the checkpointer's files, under actor/
    load(eng, root / "step_000001")                    # the checkpointer's resume path
    folder = tiny_unmapped_model(out, "olmo2")         # an architecture Megatron does not map
    gap, moved = export_gap(folder, ckpt, work, ids)   # export --hf in transformers vs the resumed engine

Used from the pytest side (tests/ is on sys.path there) and from rank scripts (which put tests/
on sys.path themselves).
"""
from __future__ import annotations

import contextlib
from pathlib import Path

ROLE = "actor"


@contextlib.contextmanager
def one_rank_world(tmp):
    """A one-rank gloo world in this process for the block (the FSDP engine's, a checkpoint's)."""
    import torch.distributed as dist

    tmp = Path(tmp)
    tmp.mkdir(parents=True, exist_ok=True)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def make_batch(seed: int, n: int = 8):
    """n random prompt/response pairs with seeded advantages and behaviour log-probs (old_log_probs
    near a tiny model's: log(1 / 500) ~ -6.2), the keys PolicyObjective reads."""
    import torch

    from verl_hpc.engines.batch import get_response_mask, pack_sequences

    g = torch.Generator().manual_seed(seed)
    plen, rlen = torch.randint(2, 9, (n,), generator=g), torch.randint(1, 11, (n,), generator=g)
    prompts = [torch.randint(5, 480, (int(p),), generator=g).tolist() for p in plen]
    resps = [torch.randint(5, 480, (int(r),), generator=g).tolist() for r in rlen]
    batch = pack_sequences(prompts, resps)
    mask = get_response_mask(batch)
    batch["advantages"] = torch.randn(mask.shape, generator=g) * mask
    batch["old_log_probs"] = (-6.2 + 0.1 * torch.randn(mask.shape, generator=g)) * mask
    return batch


def actor_cfg():
    from verl_hpc.config.schema import ActorConfig

    return ActorConfig(ppo_mini_batch_size=8, micro_batch_size=4)


def optim_cfg():
    """Adam with eps 1 (the first steps SGD-like: weights then compare gradients, not the sign of
    rounding noise) and a linear LR decay, so a resumed schedule or step count that is off shows."""
    from verl_hpc.config.schema import OptimConfig

    return OptimConfig(lr=0.5, eps=1.0, clip_grad=1.0, weight_decay=0.0, lr_decay_style="linear", min_lr=0.1)


def engine(kind: str, model, **changes):
    """A trainable engine of `kind` (fsdp | megatron) on the model folder: the actor's, or with
    `changes` (EngineOptions fields: head="value" for a critic)."""
    from verl_hpc.engines.options import default_options

    opts = default_options(model_path=str(model), engine=kind, optim=optim_cfg(), micro_batch_size=4,
                           total_steps=10, use_distributed_optimizer=True, **changes)
    if kind == "fsdp":
        from verl_hpc.engines.fsdp import FsdpEngine

        return FsdpEngine(opts)
    from verl_hpc.engines.megatron import MegatronEngine

    return MegatronEngine(opts)


def update(eng, batch) -> dict:
    from verl_hpc.algorithms import PolicyObjective
    from verl_hpc.engines.roles import Actor

    acfg = actor_cfg()
    return Actor(eng, acfg).update(batch, PolicyObjective.from_config(acfg))


def weights(eng) -> dict:
    """{HF name: full tensor} (collective: every rank calls it)."""
    return {n: t.detach().clone() for n, t in eng.export_hf_weights()}


def save(eng, root, step: int, layout: dict, model=None) -> dict:
    """The engine's state as the trainer's checkpointer writes it (under `actor/`, with model.path
    in the config an export reads); its meta."""
    import yaml

    from verl_hpc.checkpoint import save_checkpoint
    from verl_hpc.checkpoint.checkpointer import _prefixed

    st = eng.state()
    config = yaml.safe_dump({"model": {"path": str(model or eng.options.model_path)}})
    save_checkpoint(root, step, _prefixed(ROLE, st.tensors),
                    metadata={"config": config, "trainer_state": {"engines": {ROLE: st.meta}}}, layout=layout)
    return st.meta


def load(eng, path) -> dict:
    """Resume `eng` from the checkpoint at `path` as the checkpointer does; the meta it read."""
    from verl_hpc.checkpoint import open_checkpoint
    from verl_hpc.checkpoint.checkpointer import RoleLoader

    with open_checkpoint(path) as r:
        meta = r.metadata["trainer_state"]["engines"][ROLE]
        eng.load_state(RoleLoader(r, ROLE), meta)
    return meta


def tiny_unmapped_model(out, family: str = "olmo2", *, layers: int = 2, seed: int = 0) -> Path:
    """A tiny HF folder of an architecture outside Megatron's mapping (olmo2 | phi3), built from
    its transformers config with random weights (verl_hpc.models.tiny's draw: norms 1 + noise),
    with the tiny models' tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, Olmo2Config, Phi3Config

    from verl_hpc.models.tiny import random_state_dict, train_tokenizer

    out = Path(out)
    tok = train_tokenizer()
    ids = {k: tok.convert_tokens_to_ids(f"<|{k}|>") for k in ("bos", "eos", "pad")}
    common = dict(vocab_size=500, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  bos_token_id=ids["bos"], eos_token_id=ids["eos"], pad_token_id=ids["pad"],
                  tie_word_embeddings=False)
    cls, arch = {"olmo2": (Olmo2Config, "Olmo2ForCausalLM"), "phi3": (Phi3Config, "Phi3ForCausalLM")}[family]
    config = cls(**common, architectures=[arch])
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(random_state_dict(model, seed))
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def grpo_batch(groups=3, n=4, prompt=9, seed=0):
    """GRPO groups: n responses (2-6 tokens) to each of `groups` prompts of prompt..prompt+3 tokens,
    with random advantages on the response tokens: what the prompt-sharing (packed) layout packs."""
    import torch

    from verl_hpc.engines.batch import get_response_mask, pack_sequences

    g = torch.Generator().manual_seed(seed)
    prompts, resps = [], []
    for _ in range(groups):
        p = torch.randint(5, 480, (prompt + int(torch.randint(0, 4, (1,), generator=g)),), generator=g).tolist()
        for _ in range(n):
            prompts.append(p)
            resps.append(torch.randint(5, 480, (int(torch.randint(2, 7, (1,), generator=g)),), generator=g).tolist())
    b = pack_sequences(prompts, resps)
    mask = get_response_mask(b)
    return dict(b, response_mask=mask, advantages=torch.randn(mask.shape, generator=g) * mask)


def grpo_policy_batch(groups=4, n=2, prompt=7, seed=5):
    """grpo_batch with the rest of the policy loss's inputs: old and reference log-probs near -6."""
    import torch

    b = grpo_batch(groups, n, prompt, seed)
    g, mask = torch.Generator().manual_seed(seed + 1), b["response_mask"]
    return dict(b, old_log_probs=(-6.0 + 0.3 * torch.randn(mask.shape, generator=g)) * mask,
                ref_log_probs=(-6.0 + 0.3 * torch.randn(mask.shape, generator=g)) * mask)


def export_gap(model, ckpt, work, ids) -> tuple:
    """`checkpoint export --hf` of the checkpoint `ckpt` (a job's, trained from the folder `model`)
    into work/hf, loaded in transformers, against the FSDP engine resumed from `ckpt` at one rank
    (its checkpoints load at any rank count): (max |export - engine| of the logits of `ids`,
    max |start - engine|: how far training moved the model, so that a gap of 0 means something)."""
    import gc

    import torch
    from transformers import AutoModelForCausalLM

    from verl_hpc.checkpoint.hf_export import export_hf

    work, ids = Path(work), torch.as_tensor(ids)
    export_hf(ckpt, work / "hf")
    with torch.no_grad():
        got = AutoModelForCausalLM.from_pretrained(work / "hf", dtype=torch.float32).eval()(ids).logits
        before = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()(ids).logits
    with one_rank_world(work / "world"):
        eng = engine("fsdp", model)
        load(eng, ckpt)
        eng.model.eval()
        with torch.no_grad():
            want = eng.model(input_ids=ids).logits.detach().clone()
        del eng
        gc.collect()
    return float((got - want).abs().max()), float((before - want).abs().max())
