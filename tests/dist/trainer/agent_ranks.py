"""A rank of a 2-rank GRPO job whose samples are agent runs (test_agent_ranks.py launches two).

The job is the product's own (`verl_hpc.job.main`, one step); this script only watches it: every
call the endpoint of this rank records (Session.record), the port of this rank's endpoint, the base
URLs its agents were given (agent_programs.two_calls), and the training batch the sampling stage
assembles on this rank. It writes them to WORKDIR/rank{r}.json.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "tests"))  # agent_programs, imported by the job as the user's code


def main(workdir: Path) -> None:
    import agent_programs

    from verl_hpc import job
    from verl_hpc.rollout.agents import runner as runner_mod
    from verl_hpc.rollout.agents import service
    from verl_hpc.trainer.stages import sampling

    args = json.loads((workdir / "args.json").read_text())
    calls, ports, batches = [], [], []
    record, init, assemble = service.Session.record, runner_mod.AgentRunner.__init__, sampling.assemble

    def watched_record(self, call, chat=None, reused=False):
        calls.append({"prompt": call.prompt_ids, "completion": call.completion_ids, "logprobs": call.logprobs})
        record(self, call, chat, reused)

    def watched_init(self, *a, **kw):
        init(self, *a, **kw)
        ports.append(self.server.port)

    def watched_assemble(prompts, result, tokenizer, pad_id):
        batch = assemble(prompts, result, tokenizer, pad_id)
        rows = []
        for r in range(len(batch)):
            p, n = int(batch.prompt_lengths[r]), int(batch.prompt_lengths[r] + batch.response_lengths[r])
            rows.append({"ids": batch.input_ids[r, :n].tolist(), "prompt_length": p,
                         "mask": batch.response_mask[r, :n - p].tolist(),
                         "logprobs": batch.rollout_log_probs[r, :n - p].tolist()})
        batches.append(rows)
        return batch

    service.Session.record = watched_record
    runner_mod.AgentRunner.__init__ = watched_init
    sampling.assemble = watched_assemble
    code = job.main(args["argv"])
    out = {"code": code, "calls": calls, "ports": ports, "urls": agent_programs.SEEN_URLS, "batches": batches}
    (workdir / f"rank{os.environ['RANK']}.json").write_text(json.dumps(out))
    sys.exit(code)  # a failed job fails the launch, with every rank's log tail


if __name__ == "__main__":
    main(Path(sys.argv[-1]))
