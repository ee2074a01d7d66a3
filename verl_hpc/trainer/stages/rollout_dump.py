"""`trainer.rollout_data_dir`: every RL step's samples as JSON lines, for reading what the policy
writes and how it was scored (the file verl users know by the same option).

    <rollout_data_dir>/step_000005.jsonl   one line per sample:
    {"step", "round", "id", "sample", "prompt", "response", "response_ids", "finish", "score"}
    + "versions" (split placement: the policy version of each response token)
    + for episodes (multi_turn): "episode" (the whole episode as text, tool turns included; "response"
      is its answer, the text scored), "response_mask" (1 on the model's tokens) and "turns",
      "tool_calls", "tool_errors", "end"

Rank 0 writes; a step run again (after a resume or a rollback) overwrites its file. JSON lines
rather than parquet so that `tail`, `jq` and `grep` read a step while the job runs.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path


class RolloutDump:
    def __init__(self, folder: str, rank: int, decode=None):
        """decode(ids) -> text: the tokenizer's, for episodes (special tokens kept: they delimit turns)."""
        self.folder = Path(folder) if folder and rank == 0 else None
        self.decode = decode
        if self.folder is not None:
            self.folder.mkdir(parents=True, exist_ok=True)

    def write(self, step: int, round_: int, prompts, result, batch, scores) -> None:
        """Round 0 starts the step's file; DAPO's further rounds append to it. `batch` holds the
        decoded responses in the rows of `result`, `scores` each row's outcome score."""
        if self.folder is None:
            return
        path = self.folder / f"step_{step:06d}.jsonl"
        with open(path, "w" if round_ == 0 else "a", encoding="utf-8") as f:
            for r, i in enumerate(result.prompt_index):
                row = {"step": step, "round": round_, "id": prompts.ids[i], "sample": result.sample_index[r],
                       "prompt": prompts.prompt_texts[i], "response": batch.response_texts[r],
                       "response_ids": list(result.response_ids[r]), "finish": result.finish_reason[r],
                       "score": float(scores[r])}
                if result.versions is not None:
                    row["versions"] = list(result.versions[r])
                if result.episodes is not None:
                    stats = dataclasses.asdict(result.episodes[r])
                    row.update(episode=self.decode(result.response_ids[r]), response_mask=list(result.response_mask[r]),
                               **{k: stats[k] for k in ("turns", "tool_calls", "tool_errors", "end")})
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
