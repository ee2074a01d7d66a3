"""`placement.elastic:` rollout workers that join a running split run as jobs of their own, and leave
it without ending it (docs/elastic.md)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import List

from verl_hpc.config.fields import WEEK_S, Section, opt

LOST_SAMPLES = ("continue", "regenerate")


@dataclass
class ElasticConfig(Section):
    enable: bool = opt(False, "accept rollout workers that join this split run (python -m verl_hpc.submit "
                              "--join RUN_DIR); the run's own rollout ranks keep generating too")
    min_rollout_workers: int = opt(0, "joined workers below which training waits; past lost_timeout_s the run "
                                      "stops naming the workers lost (0: never waits for workers)", check=">=0")
    lost_timeout_s: float = opt(1800.0, "how long the pool may stay below min_rollout_workers", check=f"(0, {WEEK_S}]")
    heartbeat_timeout_s: float = opt(60.0, "a worker silent this long has left (killed, or its node lost)",
                                     check=f"(0, {WEEK_S}]")
    straggler_deadline_s: float = opt(600.0, "a leased prompt group not finished within this is leased again to "
                                             "another worker (the first completion of each sample is kept)",
                                      check=f"(0, {WEEK_S}]")
    lost_samples: str = opt("regenerate", "what happens to a leaving worker's unfinished samples: regenerate "
                                          "(from the start) | continue (from the tokens it reported)",
                            choices=LOST_SAMPLES)
    groups_per_lease: int = opt(4, "prompt groups a worker takes per request", check=">0")

    def check(self, job) -> List[str]:
        if not self.enable:
            return []
        p = []
        if not job.placement.split:
            p.append("placement.elastic.enable = true needs placement.mode = split (the run's own rollout ranks "
                     "coordinate the workers)")
        if job.async_training.chunk_tokens:
            p.append(f"placement.elastic.enable = true with async_training.chunk_tokens = "
                     f"{job.async_training.chunk_tokens}: elastic workers generate whole responses; set 0")
        if self.lost_samples == "continue":
            p.append("placement.elastic.lost_samples = continue needs chunked generation, which elastic workers "
                     "do not run yet: use regenerate")
        if self.heartbeat_timeout_s >= self.straggler_deadline_s:
            p.append(f"placement.elastic.heartbeat_timeout_s = {self.heartbeat_timeout_s:g} must be below "
                     f"straggler_deadline_s = {self.straggler_deadline_s:g} (a silent worker is taken out "
                     "before its work is re-dispatched)")
        return p
