"""The chunked output layer (verl_hpc/engines/logits.py; model.logits_chunk_tokens): log-probs,
entropy, sum-pi-squared and their gradients equal the whole-logits path within EXACT (fp32, CPU):

- the function itself against torch's log_softmax / the project's entropy over whole logits, with
  chunks that do not divide the tokens, temperature, a vocabulary slice whose target may lie on
  another rank (vocab_start), and its gradients in the hidden states and the weight;
- both engines (FSDP: the model's lm_head in chunks; Megatron: its output layer's hidden states,
  the padded vocabulary sliced off): the forward's three outputs and one actor update (PPO with
  the KL and entropy terms, so both differentiable outputs carry gradient) with chunks of 5 tokens
  against model.logits_chunk_tokens = 0 (the whole logits), untied Llama and tied Qwen2, with and
  without temperature, and packed rows (prompt sharing);
- the auto rule and the refusals.
Tensor parallelism (tp 2 on gloo): tests/dist/engines/test_chunked_logits_tp.py.

EXACT is relative to the largest magnitude compared (the chunks change only the order of the
weight gradient's sums over tokens).
"""
import dataclasses

import pytest
import torch

from engine_states import grpo_policy_batch
from update_reference import max_diff, policy_batch
from verl_hpc.config.schema import ActorConfig, OptimConfig

EXACT = 1e-6
OPTIM = OptimConfig(lr=0.5, eps=1.0, clip_grad=0.0, weight_decay=0.01)  # eps = 1: the step shows the gradient
ACTOR = ActorConfig(ppo_mini_batch_size=8, entropy_coeff=0.01, use_kl_loss=True, kl_loss_coef=0.1)
FAMILIES = {"llama": dict(family="llama", layers=2), "qwen2": dict(family="qwen2", tied=True, layers=2, seed=1)}


def _close(got, want, what=""):
    got, want = got.detach(), want.detach()
    scale = max(1.0, float(want.abs().max()))
    assert float((got - want).abs().max()) <= EXACT * scale, what


def _reference(hidden, weight, targets, temperature):
    from verl_hpc.algorithms import entropy_from_logits, sum_pi_squared_from_logits

    z = (hidden @ weight.t()).float() / temperature
    return {"log_probs": torch.log_softmax(z, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1),
            "entropy": entropy_from_logits(z), "sum_pi_squared": sum_pi_squared_from_logits(z)}


@pytest.mark.parametrize("temperature, chunk", [(1.0, 7), (0.7, 5), (0.7, 1000)])
def test_function_equals_whole_logits_and_its_gradients(temperature, chunk):
    from verl_hpc.engines.logits import OUTPUTS, token_outputs

    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 11, 16, generator=g).requires_grad_()
    weight = (0.5 * torch.randn(97, 16, generator=g)).requires_grad_()
    targets = torch.randint(0, 97, (3, 11), generator=g)
    want = _reference(hidden, weight, targets, temperature)
    got = token_outputs(hidden, weight, targets, OUTPUTS, temperature=temperature, chunk=chunk)
    for k in OUTPUTS:
        assert got[k].shape == targets.shape and got[k].dtype == torch.float32
        _close(got[k], want[k], k)
    assert not got["sum_pi_squared"].requires_grad
    up = torch.randn(2, 3, 11, generator=g)
    grads = [torch.autograd.grad((o["log_probs"] * up[0]).sum() + (o["entropy"] * up[1]).sum(), (hidden, weight),
                                 retain_graph=True) for o in (want, got)]
    for w, c, name in zip(grads[0], grads[1], ("hidden", "weight")):
        assert float(w.abs().max()) > 1e-2, name  # a gradient that is there
        _close(c, w, name)
    # one output alone: the other's gradient is not asked for
    lp = token_outputs(hidden, weight, targets, ("log_probs",), temperature=temperature, chunk=chunk)["log_probs"]
    gh = torch.autograd.grad(lp.sum(), hidden)[0]
    _close(gh, torch.autograd.grad(want["log_probs"].sum(), hidden)[0], "log_probs only")


def test_vocab_slices_sum_to_the_whole_vocabulary():
    """Two slices of the vocabulary, each with its own max and sums, combined as the TP all-reduce
    would (here by hand): the target's logit comes from the slice that holds it."""
    from verl_hpc.engines import logits as lib

    g = torch.Generator().manual_seed(1)
    hidden, weight = torch.randn(9, 8, generator=g), torch.randn(20, 8, generator=g)
    targets = torch.randint(0, 20, (9,), generator=g)
    want = _reference(hidden, weight, targets, 1.0)
    z = [lib._chunk_logits(hidden, w, 1.0) for w in (weight[:12], weight[12:])]
    m = torch.maximum(z[0].amax(-1), z[1].amax(-1))
    total = torch.zeros(9)
    tgt = torch.zeros(9)
    for part, start in zip(z, (0, 12)):
        total += torch.exp(part - m.unsqueeze(1)).sum(-1)
        cols, mine = lib._target_columns(targets, start, part.shape[1])
        tgt += torch.where(mine, part.gather(1, cols.unsqueeze(1)).squeeze(1) - m, 0.0)
    _close(tgt - torch.log(total), want["log_probs"])


def test_bad_inputs_name_what_is_wrong():
    from verl_hpc.engines.logits import token_outputs

    h, w, t = torch.zeros(2, 3, 4), torch.zeros(5, 4), torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="asked for"):
        token_outputs(h, w, t, ("logits",))
    with pytest.raises(ValueError, match="targets"):
        token_outputs(h, w, t[:, :2], ("log_probs",))
    with pytest.raises(ValueError, match=r"output weight \(5, 3\)"):
        token_outputs(h, w[:, :3], t, ("log_probs",))
    with pytest.raises(ValueError, match="chunk"):
        token_outputs(h, w, t, ("log_probs",), chunk=0)


def test_auto_chunk_follows_the_vocabulary_slice():
    from verl_hpc.config.sections.model import LOGITS_CHUNK_BYTES, logits_chunk_size

    assert logits_chunk_size(0, 151936) == 0 and logits_chunk_size(96, 151936) == 96
    qwen = logits_chunk_size(None, 151936)
    assert qwen % 16 == 0 and qwen * 151936 * 4 <= LOGITS_CHUNK_BYTES < (qwen + 16) * 151936 * 4
    assert logits_chunk_size(None, 151936 // 8) > 7 * qwen  # tp 8: a slice of 1/8 takes ~8x the tokens
    assert logits_chunk_size(None, 10 ** 9) == 16  # never below 16 tokens


def test_config_refuses_a_negative_chunk():
    from verl_hpc.config import load_config, validate
    from verl_hpc.config.errors import ConfigError

    with pytest.raises(ConfigError, match="logits_chunk_tokens"):
        validate(load_config(None, ["model.logits_chunk_tokens=-1"]), check_model=False)


# ----------------------------------------------------------------------------- the engines


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from verl_hpc.models.tiny import make_tiny_model

    root, built = tmp_path_factory.mktemp("chunk_models"), {}

    def get(family):
        if family not in built:
            built[family] = make_tiny_model(root / family, **FAMILIES[family])
        return built[family]

    return get


def _engine(kind, folder, **changes):
    from verl_hpc.engines.options import default_options

    o = default_options(str(folder), engine=kind, optim=OPTIM, total_steps=4, **changes)
    if kind == "fsdp":
        from verl_hpc.engines.fsdp import FsdpEngine

        return FsdpEngine(o)
    from verl_hpc.engines.megatron import MegatronEngine
    from verl_hpc.parallel import init_model_parallel

    init_model_parallel(1, 1)
    return MegatronEngine(o)


def _update(engine, batch):
    from verl_hpc.algorithms import PolicyObjective
    from verl_hpc.engines.roles import Actor

    metrics = Actor(engine, ACTOR).update(batch, PolicyObjective.from_config(ACTOR))
    return metrics, {n: t.clone() for n, t in engine.export_hf_weights()}


CASES = [("fsdp", "llama", 1.0, "off"), ("fsdp", "qwen2", 0.7, "off"), ("fsdp", "qwen2", 0.7, "on"),
         ("megatron", "llama", 1.0, "off"), ("megatron", "qwen2", 0.7, "off"), ("megatron", "llama", 0.7, "on")]


@pytest.mark.parametrize("kind, family, temperature, share", CASES)
def test_engine_chunks_equal_the_whole_logits(one_rank_world, models, kind, family, temperature, share,
                                              monkeypatch):
    folder = models(family)
    batch = grpo_policy_batch(seed=5) if share == "on" else policy_batch(6)
    results, calls = {}, _count_chunked_passes(monkeypatch)
    for chunk in (5, 0):
        calls.clear()
        eng = _engine(kind, folder, temperature=temperature, share_prompts=share, logits_chunk_tokens=chunk,
                      micro_batch_size=8 if share == "on" else 4)
        out = eng.forward(batch, ("log_probs", "entropy", "sum_pi_squared"))
        metrics, weights = _update(eng, batch)
        results[chunk] = (out, metrics, weights)
        assert (len(calls) > 0) == (chunk > 0), calls  # chunk 5: every micro-batch scores more tokens
    (out, metrics, weights), (out0, metrics0, weights0) = results[5], results[0]
    for key in out0:
        _close(out[key], out0[key], key)
    assert float(out0["entropy"].abs().max()) > 1.0  # the outputs are there (a 480-token vocabulary)
    assert max_diff(weights, weights0) <= EXACT
    assert max_diff(weights0, {n: t for n, t in _start(folder).items() if n in weights0}) > 1e-3
    for key in ("actor/loss", "actor/pg_loss", "actor/entropy_loss", "actor/grad_norm"):
        assert metrics[key] == pytest.approx(metrics0[key], rel=EXACT, abs=EXACT), key
    if share == "on":
        assert metrics["actor/packed_microbatches"] > 0 and metrics0["actor/packed_microbatches"] > 0


def _count_chunked_passes(monkeypatch):
    """The token counts the chunked function is called with, in order."""
    from verl_hpc.engines import logits as lib

    calls, apply = [], lib._ChunkedOutputs.apply

    def counting(hidden, *args):
        calls.append(hidden.shape[0])
        return apply(hidden, *args)

    monkeypatch.setattr(lib._ChunkedOutputs, "apply", counting)
    return calls


@pytest.mark.parametrize("kind", ["fsdp", "megatron"])
def test_a_micro_batch_within_one_chunk_keeps_the_whole_logits(one_rank_world, models, kind, monkeypatch):
    """Only a micro-batch that scores more tokens than a chunk goes through the chunks: one that fits
    one chunk (every micro-batch of the auto chunk at a small vocabulary, as in the demos) runs the
    whole-logits path, bitwise, so small jobs' figures stay what they were."""
    from verl_hpc.config.sections.model import logits_chunk_size, scores_in_chunks

    batch = policy_batch(6)
    scored = batch["response_mask"].shape[1] * 4  # one micro-batch of 4 rows at the batch's width
    assert not scores_in_chunks(logits_chunk_size(None, 512), scored)  # auto at this vocabulary
    calls = _count_chunked_passes(monkeypatch)
    results = {}
    for chunk in (scored, 0, scored - 1):
        calls.clear()
        eng = _engine(kind, models("llama"), logits_chunk_tokens=chunk, micro_batch_size=4)
        out = eng.forward(batch, ("log_probs", "entropy"))
        metrics, weights = _update(eng, batch)
        results[chunk] = (out, weights, list(calls))
    (out, weights, calls_fit), (out0, weights0, _), (_, _, calls_over) = (results[k] for k in (scored, 0, scored - 1))
    assert calls_fit == [] and calls_over and max(calls_over) <= scored
    for key in out0:
        assert torch.equal(out[key], out0[key]), key
    assert all(torch.equal(weights[n], weights0[n]) for n in weights0)


def _start(folder):
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


def test_fsdp_keeps_the_logits_where_the_model_transforms_them():
    from types import SimpleNamespace

    from verl_hpc.engines.fsdp.head import logits_transform

    assert logits_transform(SimpleNamespace(final_logit_softcapping=30.0)) == "final_logit_softcapping"
    assert logits_transform(SimpleNamespace(text_config=SimpleNamespace(logit_scale=0.0625))) == "logit_scale"
    assert logits_transform(SimpleNamespace(final_logit_softcapping=None, logits_scaling=1.0)) is None


# ----------------------------------------------------------------------------- the memory plan

_PEAK_SCRIPT = """
import json, sys, torch
from verl_hpc.engines.logits import token_outputs
from verl_hpc.runtime.memory_peaks import HostPeaks
torch.set_num_threads(1)
n, h, v, chunk = (int(x) for x in sys.argv[1:5])
g = torch.Generator().manual_seed(0)
hidden = torch.randn(n, h, generator=g).requires_grad_()
weight = (0.1 * torch.randn(v, h, generator=g)).requires_grad_()
targets = torch.randint(0, v, (n,), generator=g)
probe = HostPeaks()
probe.reset()
start = probe.current()
out = token_outputs(hidden, weight, targets, ("log_probs", "entropy"), chunk=chunk)
(out["log_probs"].sum() + out["entropy"].sum()).backward()
print(json.dumps({"rise": probe.peak() - start}))
"""


@pytest.mark.parametrize("chunk", [256, 512])
@pytest.mark.heavy
def test_plan_counts_the_chunk_the_function_holds(tmp_path, chunk):
    """The resident peak of one forward + backward of the chunked function (own process, glibc's
    mmap threshold fixed so that freed chunks leave the resident set: runtime/memory_peaks.py)
    beyond the gradients it returns (hidden's and the weight's) is the plan's working chunk and
    per-token numbers (planning/training.py) within the plan's 15% band for activations."""
    import json
    import os
    import subprocess
    import sys

    from verl_hpc.planning.training import CHUNK_TOKEN_BYTES, chunk_working_bytes

    n, h, v = 2048, 64, 50000
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(128 << 10), OMP_NUM_THREADS="1")
    run = subprocess.run([sys.executable, "-c", _PEAK_SCRIPT, str(n), str(h), str(v), str(chunk)], env=env,
                         capture_output=True, text=True, timeout=120, check=True)
    rise = json.loads(run.stdout.strip().splitlines()[-1])["rise"]
    grads = 4 * (n * h + v * h)
    planned = chunk_working_bytes(chunk, v, 4) + CHUNK_TOKEN_BYTES * n
    assert rise - grads == pytest.approx(planned, rel=0.15)
    assert planned < chunk_working_bytes(n, v, 4) / 3  # the whole tokens' logits at once: n / chunk times it


# ----------------------------------------------------------------------------- the optimizer step


def test_fsdp_adam_is_fused_and_resumes_its_step_on_the_parameters_device(one_rank_world, models, tmp_path):
    """torch's fused AdamW in the FSDP engine; a resumed step count is a float32 scalar on each
    parameter's device (the fused kernel takes a parameter's states from one device), and the
    resumed engine's next update equals the uninterrupted one's."""
    import engine_states as es

    folder = models("llama")
    a, b = policy_batch(11), policy_batch(12)
    first = es.engine("fsdp", folder)
    assert all(g["fused"] for g in first.optimizer.param_groups)
    es.update(first, a)
    path = tmp_path / "ckpt"
    es.save(first, path, 1, layout={})
    es.update(first, b)
    resumed = es.engine("fsdp", folder)
    es.load(resumed, path)
    for group in resumed.optimizer.param_groups:
        for p in group["params"]:
            step = resumed.optimizer.state[p]["step"]
            assert step.dtype == torch.float32 and step.device == p.device and float(step) == 1.0
    es.update(resumed, b)
    assert max_diff(es.weights(resumed), es.weights(first)) <= 1e-6
