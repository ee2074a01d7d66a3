"""What to sample: `SamplingSpec`, built from the `rollout` config section or by hand.

A spec is the whole description of one `generate` call's sampling. Generation is a pure function
of (weights, prompts, spec): the same spec on the same weights gives the same samples. The trainer
must therefore vary the seed per step (`spec.for_step(step)`), or every step would reuse the same
random noise; deriving it from the step (rather than from a counter inside the engine) keeps a run
that resumes from a checkpoint on the same random stream as one that never stopped.

Seeds are per request: prompt i of a call samples with `request_seed(spec.seed, i)` and vLLM gives
its j-th sample seed+j. Because i is the prompt's index in the *global* list, the samples do not
depend on how prompts are split over data-parallel replicas (vLLM; HF samples a batch from one
generator, so its samples depend on the batch it was in).
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
from typing import Tuple

LOGPROBS_MODES = ("processed", "raw")


@dataclasses.dataclass(frozen=True)
class SamplingSpec:
    """Every field is required: values and their checks live in the `rollout:` section, and
    `from_config` is the one place that reads them. Code without a config (tests, benchmarks)
    starts from `default_spec()` and replaces what it varies."""
    n: int  # responses per prompt
    temperature: float  # 0 = greedy (validation; training sampling is > 0, see the rollout section)
    top_p: float
    top_k: int  # -1 = off
    max_tokens: int
    stop: Tuple[str, ...]  # stop strings (the token that completes one is kept)
    seed: int
    min_tokens: int  # EOS is masked until this many tokens (benchmarks: exact lengths); not a config field

    def __post_init__(self):
        object.__setattr__(self, "stop", tuple(self.stop))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def for_step(self, step: int, round_: int = 0) -> "SamplingSpec":
        """The same spec with a seed of its own for training step `step` (see module doc), and for
        each further generation round of that step (DAPO's refill) another one."""
        parts = ("step", step) if round_ == 0 else ("step", step, "round", round_)
        return dataclasses.replace(self, seed=request_seed(self.seed, *parts) % 2**31)

    @classmethod
    def from_config(cls, r) -> "SamplingSpec":
        """Training sampling from the `rollout:` section of a loaded config (max_tokens resolved).
        min_tokens is 0: no config field asks for forced lengths."""
        return cls(n=r.n, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                   max_tokens=r.max_tokens, stop=tuple(r.stop), seed=r.seed, min_tokens=0)

    @classmethod
    def validation_from_config(cls, r) -> "SamplingSpec":
        """Validation sampling: one response per prompt at rollout.val_temperature (0 = greedy),
        otherwise as training (top_p/top_k apply only when val_temperature > 0)."""
        return dataclasses.replace(cls.from_config(r), n=1, temperature=r.val_temperature)


@functools.lru_cache(maxsize=1)
def _default_section_spec() -> SamplingSpec:
    from verl_hpc.config import load_config  # lazily: the config package is not needed to sample

    return SamplingSpec.from_config(load_config(None).rollout)


def default_spec(**changes) -> SamplingSpec:
    """The spec of the default `rollout:` section (resolved), with `changes` replaced: for code that
    samples without a job config (tests, benchmarks)."""
    return dataclasses.replace(_default_section_spec(), **changes)


def request_seed(base: int, *parts) -> int:
    """A 62-bit seed from a base seed and any labels, stable across processes and Python runs
    (unlike hash()); children seeds base+j (j < n) stay far from the next prompt's seed."""
    text = ":".join(str(p) for p in (base, *parts)).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") >> 2


def check_logprobs_mode(mode: str) -> str:
    if mode not in LOGPROBS_MODES:
        raise ValueError(f"logprobs_mode={mode!r} is not one of {', '.join(LOGPROBS_MODES)}")
    return mode
