"""`teacher:` on-policy distillation: a frozen teacher scores every token the student samples.

The student (the actor) samples responses as in any RL step; the teacher, a frozen causal LM from
its own Hugging Face folder, gives the log-prob of each sampled token, and the student is pushed
toward the teacher on its own samples by the per-token reverse KL

    kl_t = log pi(y_t | y_<t) - log pi_T(y_t | y_<t)

(verl_hpc/algorithms/distill.py; docs/algorithms.md, "On-policy distillation"). Two ways in:
`reward` adds coef x -kl_t (pi = the sampling policy, pi_old) to every token's advantage, beside
the task advantages of algorithm.adv_estimator (no critic); `loss` adds coef x the aggregated kl
to the actor's loss. Either way `teacher/kl` (the batch's mean kl per token) is logged each step.

The teacher scores the student's token ids, so both must share one tokenizer: a teacher whose
tokenizer differs is refused at load, naming both folders. It runs on the training ranks (in split
placement too: the training group's, beside the actor, scoring the batches the rollout group
streams), on the actor's engine unless teacher.engine says otherwise, in the training layout, frozen (no optimizer,
never in a checkpoint: rebuilt from its folder), its weights in host memory while idle with
teacher.param_offload.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List

from verl_hpc.config.fields import Section, opt

TEACHER_MODES = ("reward", "loss")
TEACHER_ENGINES = ("actor", "megatron", "fsdp")


@dataclass
class TeacherConfig(Section):
    enable: bool = opt(False, "on-policy distillation from a frozen teacher (trainer.job = rl)")
    model_path: str = opt("", "the teacher's Hugging Face folder (its tokenizer must be the student's); with "
                              "teacher.by_data_source: the teacher of the sources not listed there ('' = none)")
    by_data_source: Dict[str, str] = opt({}, "several teachers: data_source -> teacher folder, e.g. {gsm8k: "
                                             "/models/math-teacher, code: /models/code-teacher}; each scores "
                                             "the rows of its sources")
    engine: str = opt("actor", "the teacher's training engine; actor: the one the actor runs on",
                        choices=TEACHER_ENGINES)
    param_offload: bool = opt(False, "weights in host memory except while computing the teacher's log-probs")
    mode: str = opt("reward", "reward: coef x -(log pi_old - log pi_teacher) added to every token's advantage "
                              "(no critic) | loss: coef x the reverse KL (log pi - log pi_teacher) aggregated "
                              "with actor.loss_agg_mode added to the actor's loss", choices=TEACHER_MODES)
    coef: float = opt(1.0, "weight of the distillation signal beside the task rewards' advantages (reward) or "
                           "the policy loss (loss)", check=">=0")

    def check(self, job) -> List[str]:
        if not self.enable:
            return []
        p = []
        if job.trainer.job != "rl":
            p.append(f"teacher.enable: on-policy distillation scores sampled responses, trainer.job = "
                     f"{job.trainer.job} samples none; valid: trainer.job = rl (or teacher.enable=false)")
            return p
        if not self.model_path and not self.by_data_source:
            p.append("teacher.model_path: empty; teacher.enable needs the teacher's Hugging Face folder (or "
                     "teacher.by_data_source, data_source -> folder)")
        p += [f"teacher.by_data_source.{k}: empty folder; valid: a teacher's Hugging Face folder"
              for k, v in self.by_data_source.items() if not v]
        if self.coef == 0:
            p.append("teacher.coef = 0: the teacher would change nothing; set it > 0 or teacher.enable=false")
        if self.mode == "reward" and job.critic.wanted(job):
            p.append("teacher.mode = reward adds the distillation advantage per token and takes no critic, but "
                     f"algorithm.adv_estimator = {job.algorithm.adv_estimator} (critic.enable) trains one: pick a "
                     "critic-free estimator (grpo, rloo, ...) or teacher.mode = loss")
        return p

    def engine_for(self, job) -> str:
        """megatron | fsdp: teacher.engine, with `actor` resolved to the engine the actor's folder
        gets under parallel.engine (verl_hpc.config.sections.fsdp.choose_engine)."""
        if self.engine != "actor":
            return self.engine
        from verl_hpc.config.sections.fsdp import choose_engine

        return choose_engine(job.parallel.engine, job.model.path, job.parallel, "model.path")

    def folders(self) -> Dict[str, str]:
        """Every teacher folder, by the field that names it (model_path first)."""
        out = {"teacher.model_path": self.model_path} if self.model_path else {}
        out.update({f"teacher.by_data_source.{k}": v for k, v in self.by_data_source.items() if v})
        return out

    def folder_of(self, data_source: str) -> str:
        """The folder of the teacher that scores rows of `data_source` ('' = none)."""
        return self.by_data_source.get(data_source) or self.model_path

    def folder_problems(self, job) -> List[str]:
        """Checks that read the file system (validate(check_model=True)): each teacher's folder
        exists and its tokenizer is the student's (model.tokenizer_path)."""
        if not (self.enable and job.trainer.job == "rl"):
            return []
        p, student = [], job.model.tokenizer_path or job.model.path
        for field, folder in self.folders().items():
            if not Path(folder).is_dir():
                p.append(f"{field}: no such folder '{folder}'")
                continue
            why = tokenizer_difference(student, folder, job.model.trust_remote_code)
            if why:
                p.append(f"{field}: the teacher's tokenizer ({folder}) is not the student's (model.tokenizer_path: "
                         f"{student}): {why}; the teacher scores the student's token ids, so both must share "
                         "one tokenizer")
        return p


def tokenizer_difference(student: str, teacher: str, trust_remote_code: bool = False) -> str:
    """'' when the two folders' tokenizers map every token and special token alike, else what
    differs first (the vocabularies, or a special token's id)."""
    from transformers import AutoTokenizer

    try:
        a = AutoTokenizer.from_pretrained(student, trust_remote_code=trust_remote_code)
        b = AutoTokenizer.from_pretrained(teacher, trust_remote_code=trust_remote_code)
    except Exception as e:  # noqa: BLE001 - a folder without a tokenizer: say so on the one line
        return f"a tokenizer does not load ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
    va, vb = a.get_vocab(), b.get_vocab()
    if va != vb:
        differ = len(set(va.items()) ^ set(vb.items()))
        return f"their vocabularies differ ({len(va)} and {len(vb)} tokens, {differ} token/id pairs not shared)"
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if getattr(a, name) != getattr(b, name):
            return f"{name} is {getattr(a, name)} and {getattr(b, name)}"
    return ""
