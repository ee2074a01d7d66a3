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
import hashlib
from typing import Tuple

LOGPROBS_MODES = ("processed", "raw")


@dataclasses.dataclass(frozen=True)
class SamplingSpec:
    n: int = 1  # responses per prompt
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 = off
    max_tokens: int = 128
    stop: Tuple[str, ...] = ()  # stop strings (the token that completes one is kept)
    seed: int = 0
    min_tokens: int = 0  # EOS is masked until this many tokens (benchmarks: exact lengths)

    def __post_init__(self):
        object.__setattr__(self, "stop", tuple(self.stop))
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def validate(self) -> "SamplingSpec":
        """Raise ValueError naming the `rollout.*` field at fault and what would be valid."""
        checks = [
            (isinstance(self.n, int) and self.n >= 1, "rollout.n", self.n, "an integer >= 1"),
            (self.temperature >= 0, "rollout.temperature", self.temperature, ">= 0 (0 = greedy)"),
            (0 < self.top_p <= 1, "rollout.top_p", self.top_p, "in (0, 1]"),
            (isinstance(self.top_k, int) and (self.top_k == -1 or self.top_k >= 1),
             "rollout.top_k", self.top_k, "-1 (off) or an integer >= 1"),
            (isinstance(self.max_tokens, int) and self.max_tokens >= 1, "rollout.max_tokens",
             self.max_tokens, "an integer >= 1"),
            (isinstance(self.min_tokens, int) and 0 <= self.min_tokens <= self.max_tokens,
             "min_tokens", self.min_tokens, f"between 0 and max_tokens={self.max_tokens}"),
            (all(isinstance(s, str) and s for s in self.stop), "rollout.stop", list(self.stop),
             "a list of non-empty strings"),
            (isinstance(self.seed, int) and self.seed >= 0, "rollout.seed", self.seed,
             "an integer >= 0"),
        ]
        for ok, field, value, valid in checks:
            if not ok:
                raise ValueError(f"{field}={value!r} is not valid: expected {valid}")
        return self

    def for_step(self, step: int, round_: int = 0) -> "SamplingSpec":
        """The same spec with a seed of its own for training step `step` (see module doc), and for
        each further generation round of that step (DAPO's refill) another one."""
        parts = ("step", step) if round_ == 0 else ("step", step, "round", round_)
        return dataclasses.replace(self, seed=request_seed(self.seed, *parts) % 2**31)

    @classmethod
    def from_config(cls, r) -> "SamplingSpec":
        """Training sampling from the `rollout:` section of a loaded config (max_tokens resolved)."""
        return cls(n=r.n, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                   max_tokens=r.max_tokens, stop=tuple(r.stop),
                   seed=r.seed)

    @classmethod
    def validation_from_config(cls, r) -> "SamplingSpec":
        """Validation sampling: one response per prompt at rollout.val_temperature (0 = greedy),
        otherwise as training (top_p/top_k apply only when val_temperature > 0)."""
        return dataclasses.replace(cls.from_config(r), n=1, temperature=r.val_temperature)


def request_seed(base: int, *parts) -> int:
    """A 62-bit seed from a base seed and any labels, stable across processes and Python runs
    (unlike hash()); children seeds base+j (j < n) stay far from the next prompt's seed."""
    text = ":".join(str(p) for p in (base, *parts)).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") >> 2


def check_logprobs_mode(mode: str) -> str:
    if mode not in LOGPROBS_MODES:
        raise ValueError(f"logprobs_mode={mode!r} is not one of {', '.join(LOGPROBS_MODES)}")
    return mode
