"""The SFT program (`trainer.job: sft`): cross-entropy on response tokens, on the actor's engine.

    python -m verl_hpc.submit configs/demo_sft.yaml --local

Rows of `data.sft_files` hold a prompt (`data.prompt_key`, text or chat messages) and a response
(`data.response_key`); the prompt is rendered with the same chat template as the RL run
(`verl_hpc.data.templates.render_prompt`), the response is appended with EOS, and only response
tokens are in the loss (token mean over the global batch). `data.train_batch_size` sequences per
optimizer step, `trainer.sft_epochs` passes, at most `trainer.total_steps` steps. At the end the
weights are written as a Hugging Face folder (`trainer.hf_output_dir`, auto: <output_dir>/hf) with
the tokenizer and config, ready to be an RL run's `model.path`.

It runs on every program's loop (trainer/programs/base.py): checkpoints per `checkpoint.save_every` and at
the last step (the actor's engine state and the data position), resume per `trainer.resume`
(bitwise: the same batches, the same optimizer state), `trainer.stop_at`, and Slurm's warning
signal or SIGTERM: save at the next step boundary, stop, requeue (runtime/requeue.py). A preempted
run writes the HF folder when its resumed job finishes.

A response may also be a multi-turn demonstration for a multi_turn RL run: a list of messages,
assistant turns with tool turns between them. It is laid out token by token as that run's episodes
are (`episode_response`), and the tools' output is not trained on.
"""
from __future__ import annotations

import logging
import math
import os
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch

from verl_hpc.algorithms import agg_loss
from verl_hpc.data import DataError, encode_prompts, read_rows
from verl_hpc.data.processor import ImagePrompts
from verl_hpc.data.records import image_field_problem, sft_row_problem
from verl_hpc.data.sampler import ShuffleStream
from verl_hpc.engines.batch import pack_sequences
from verl_hpc.rollout.episodes.chat_turns import TurnCodec
from verl_hpc.runtime.objects import broadcast_object
from verl_hpc.trainer.programs.base import (StepProgram, check_tracking, finish, make_checkpointer, save_hf,
                                             steps_from_epochs)
from verl_hpc.trainer.roles import build_engine, load_tokenizer, pad_token_id

log = logging.getLogger(__name__)
FORMAT = "verl_hpc.sft_trainer/1"  # trainer_state.format of SFT checkpoints: SFT resumes only from its own


def episode_response(codec, messages, eos) -> Tuple[List[int], List[int]]:
    """A multi-turn demonstration (assistant turns with tool turns between them) as the token ids
    an episode of the multi_turn rollout would hold, and its loss mask: 1 on the assistant's text
    (and the EOS after its last turn), 0 on the template's delimiters and the tools' output, which
    the rollout appends from the same TurnCodec."""
    ids, mask, tok = [], [], codec.tokenizer
    k = 0
    while k < len(messages):
        text = tok(str(messages[k]["content"]), add_special_tokens=False)["input_ids"]
        observations = []
        while k + 1 < len(messages) and messages[k + 1]["role"] != "assistant":
            observations.append(str(messages[k + 1]["content"]))
            k += 1
        ids += text
        mask += [1] * len(text)
        if observations:
            tail = codec.close_ids(text[-1]) + codec.observation_ids(observations, messages[k]["role"])
            ids, mask = ids + tail, mask + [0] * len(tail)
        k += 1
    if eos is not None:
        ids, mask = ids + [eos], mask + [1]
    return ids, mask


def _multi_turn_problem(value) -> str:
    if not all(isinstance(m, dict) and m.get("role") in ("assistant", "tool", "user") and "content" in m
               for m in value):
        return "a multi-turn response is a list of {role, content} messages with roles assistant, tool, user"
    if value[0]["role"] != "assistant" or value[-1]["role"] != "assistant":
        return "a multi-turn response starts and ends with an assistant message"
    if any(m["role"] == "assistant" and not str(m["content"]) for m in value):
        return "an assistant message is empty"
    return ""


def load_sft_rows(cfg, tokenizer, images=None) -> List[Tuple[List[int], List[int], Optional[List[int]], Any]]:
    """(prompt ids, response ids + EOS, loss mask or None, images or None) per row of
    data.sft_files; DataError names file and row. A response that is a list of messages is a
    multi-turn demonstration (`episode_response`): only the assistant's tokens are trained.
    images: ImagePrompts of a vision-language model (its rows' images go through the processor)."""
    d, out = cfg.data, []
    eos = tokenizer.eos_token_id
    codec = None
    vision = images if images is not None and images.processor is not None else None
    for path in d.sft_files:
        rows = read_rows(path, what="data.sft_files")
        names = [f"{Path(path).name}:{i}" for i in range(len(rows))]
        for i, row in enumerate(rows):
            problem = (sft_row_problem(row, (d.prompt_key, d.response_key))
                       or image_field_problem(row, images.image_key if images else None, vision is not None))
            if problem:
                raise DataError(f"data.sft_files '{path}' row {i}: {problem}")
        if vision is not None:
            prompts, media = _image_prompts(rows, vision, d.prompt_key, path)
        else:
            _, prompts = encode_prompts(tokenizer, [r[d.prompt_key] for r in rows], d.wrap_plain_text, names)
            media = [None] * len(rows)
        for i, (p, row) in enumerate(zip(prompts, rows)):
            value, mask = row[d.response_key], None
            if isinstance(value, list):
                problem = _multi_turn_problem(value)
                if problem:
                    raise DataError(f"data.sft_files '{path}' row {i}: field '{d.response_key}': {problem}")
                codec = codec or TurnCodec(tokenizer)
                r, mask = episode_response(codec, value, eos)
            else:
                r = tokenizer(str(value), add_special_tokens=False)["input_ids"] + ([eos] if eos is not None else [])
            if len(p) + len(r) > d.max_prompt_length + d.max_response_length:
                continue  # too long for the configured budget: dropped (counted below)
            out.append((list(p), list(r), mask, media[i]))
    return out


def _image_prompts(rows, vision, prompt_key: str, path: str):
    """Token ids (image tokens expanded) and PromptImages of image rows; a DataError names the row."""
    prompts, media = [], []
    base = os.path.dirname(os.path.abspath(path))
    for i, row in enumerate(rows):
        try:
            _, ids, m = vision.encode(row[prompt_key], row.get(vision.image_key), base)
        except DataError as e:  # it names the image; the row is named here
            raise DataError(f"data.sft_files '{path}' row {i}: {e}") from None
        prompts.append(ids)
        media.append(m)
    return prompts, media


def loss_mask(rows) -> torch.Tensor:
    """[B, T] 1 on the trained response tokens: all of them, or a multi-turn row's own mask."""
    width = max(len(r) for r, _ in rows)
    mask = torch.zeros(len(rows), width)
    for b, (r, m) in enumerate(rows):
        mask[b, :len(r)] = torch.tensor(m, dtype=mask.dtype) if m is not None else 1.0
    return mask


def nll_loss(out, mb, counts):
    mask = mb["response_mask"]
    loss = agg_loss(-out["log_probs"], mask, "token-mean", **counts.agg_kwargs())
    scale = counts.tokens / max(float(mask.sum()), 1.0)
    return loss, {"nll": loss.detach() * scale}


class SFT(StepProgram):
    """Cross-entropy on the response tokens of data.sft_files (module docstring)."""

    name = "sft"
    history_prefixes = ("sft/loss",)

    def __init__(self, cfg, ctx, rows, pad: int):
        super().__init__(cfg, ctx)
        self.rows, self.pad, self.bs = rows, pad, cfg.data.train_batch_size
        self.total_steps = steps_from_epochs(len(rows), self.bs, cfg.trainer.sft_epochs, cfg.trainer.total_steps)
        self.per_epoch = math.ceil(len(rows) / self.bs)
        self.actor = build_engine("actor", cfg, ctx, total_steps=self.total_steps)
        # the same order on every rank (same seed); a resume replays the draws
        self.sampler = ShuffleStream(len(rows), seed=cfg.data.seed, fingerprint=f"sft:{len(rows)}")
        self.checkpointer = make_checkpointer(cfg, ctx, engines={"actor": self.actor.engine},
                                              states={"loader": self.sampler}, fmt=FORMAT,
                                              total_steps=self.total_steps)

    def step(self, step: int, timer) -> Dict[str, float]:
        take = [self.rows[i] for i in self.sampler.next_indices(self.bs)]
        batch = pack_sequences([r[0] for r in take], [r[1] for r in take], self.pad)
        batch["response_mask"] = loss_mask([r[1:3] for r in take])
        if any(r[3] is not None for r in take):  # a vision-language model's images, per row
            batch["image_inputs"] = [r[3].inputs if r[3] is not None else None for r in take]
        with timer("update_actor"):
            m = self.actor.engine.train_step(batch, nll_loss, ("log_probs",))
        lr = self.actor.engine.scheduler_step()
        return {"sft/loss": m["nll"] if "nll" in m else m["loss"], "sft/grad_norm": m["grad_norm"],
                "sft/lr": lr, "sft/nonfinite": m["nonfinite"], "sft/epoch": step / self.per_epoch,
                **{f"sft/{k}": m[k] for k in ("loss_scale", "overflow") if k in m},  # fp16
                "train/tokens": float(batch["response_mask"].sum()), "train/samples": float(len(take))}

    def end(self, summary: Dict) -> None:
        if summary["stopped"] != "preempted":  # a preempted run exports when its resumed job finishes
            save_hf(self.actor.engine, self.ctx, self.cfg.model.path, self.cfg.trainer.hf_output_dir)


def run(cfg, ctx) -> dict:
    check_tracking(cfg)
    tokenizer = load_tokenizer(cfg)
    rows = broadcast_object(load_sft_rows(cfg, tokenizer, ImagePrompts.from_config(cfg.model, cfg.vision)) if ctx.rank == 0 else None)
    if not rows:
        raise DataError("trainer.job=sft: no usable rows in data.sft_files (all empty or longer than "
                        "data.max_prompt_length + data.max_response_length)")
    program = SFT(cfg, ctx, rows, pad_token_id(tokenizer))
    summary = program.fit(dict(rows=len(rows), total_steps=program.total_steps, hf_dir=cfg.trainer.hf_output_dir))
    losses = [h["sft/loss"] for h in summary.get("history", [])]
    summary.update(first_loss=losses[0] if losses else math.nan, last_loss=losses[-1] if losses else math.nan)
    if ctx.rank == 0 and losses:
        log.info("sft: steps %d..%d of %d over %d rows, loss %.3f -> %.3f; %s", summary["resumed_from"] + 1,
                 summary["steps"], program.total_steps, len(rows), losses[0], losses[-1],
                 f"HF folder {cfg.trainer.hf_output_dir}" if summary["stopped"] != "preempted" else "preempted")
    return finish(cfg, ctx, "sft", summary, requeue=program.requeue)
