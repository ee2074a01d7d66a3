"""`reward:` how responses are scored."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import List

from verl_hpc.config.fields import WEEK_S, Section, opt, section


RM_KINDS = ("scorer", "judge")
RM_NORMALIZE = ("none", "batch")
RM_SIDES = ("train_side", "rollout_side")
JUDGE_VERDICTS = ("pattern", "yes_no")
JUDGE_ENGINES = ("auto", "vllm", "hf")
DEFAULT_TEMPLATE = ("Question: {question}\nAnswer: {response}\nReference: {reference}\n"
                    "Is the answer correct? Reply yes or no.\nVerdict:")
DEFAULT_PATTERN = r"(?i)score\s*[:=]\s*(-?\d+(?:\.\d+)?)"


@dataclass
class JudgeConfig(Section):
    template: str = opt(DEFAULT_TEMPLATE, "the judge's prompt: {question} (the prompt as the policy saw it), "
                                          "{response} (required) and optionally {reference} (the ground truth)")
    verdict: str = opt("yes_no", "yes_no: P(yes) / (P(yes) + P(no)) of the judge's next token after the prompt | "
                                 "pattern: generate, and the first group of `pattern` in the text is the score",
                       choices=JUDGE_VERDICTS)
    pattern: str = opt(DEFAULT_PATTERN, "verdict = pattern: a regex whose first group is the score (a number)")
    yes_token: str = opt(" yes", "verdict = yes_no: the text of the judge's 'yes' token (one token)")
    no_token: str = opt(" no", "verdict = yes_no: the text of the judge's 'no' token (one token)")
    max_tokens: int = opt(32, "verdict = pattern: tokens the judge may generate per verdict", check=">0")
    batch_size: int = opt(32, "verdicts per engine call (each call has timeout_s)", check=">0")
    timeout_s: float = opt(180.0, "seconds per engine call; a call past it fails its verdicts (reward.on_error); "
                                  "0 = no limit", check=f"[0, {WEEK_S}]")
    max_failure_share: float = opt(0.5, "the job stops when more than this share of a step's verdicts failed "
                                        "(no parseable verdict, or a timeout), whatever reward.on_error says",
                                   check="[0, 1]")
    engine: str = opt("auto", "auto: vLLM where it is installed, else HF generate | vllm | hf",
                      choices=JUDGE_ENGINES)
    gpu_memory_utilization: float = opt(0.25, "engine = vllm on a GPU: the share of the GPU the judge's vLLM "
                                             "engine takes (beside the rollout's)", check="(0, 1]")
    def uses_vllm(self, gpu: bool, beside_vllm_rollout: bool = False) -> bool:
        """engine resolved: vllm, or auto on a GPU where vLLM is installed and no vLLM rollout shares
        the process (else HF generate). vLLM's sleep-mode allocator and its parallel state are one
        per process: a second engine beside the rollout's would be slept, woken and dropped by the
        rollout's sleep and wake (a level-2 sleep frees the judge's weights), and a tensor-parallel
        rollout's groups are not a judge's. On CPU vLLM has no sleep mode, and the two coexist."""
        import importlib.util

        if self.engine == "auto":
            return gpu and not beside_vllm_rollout and importlib.util.find_spec("vllm") is not None
        return self.engine == "vllm"


@dataclass
class RewardModelConfig(Section):
    enable: bool = opt(False, "score with a reward model")
    kind: str = opt("scorer", "scorer: a *ForSequenceClassification model's scalar on the last token | judge: a "
                              "causal LM reads the question and the response and gives a verdict",
                    choices=RM_KINDS)
    path: str = opt("", "reward model folder (scorer: a *ForSequenceClassification checkpoint sharing the "
                        "policy's tokenizer; judge: a causal LM)")
    weight: float = opt(1.0, "the reward model's score is multiplied by this before it is added to the rule's")
    rule_weight: float = opt(1.0, "the rule (or custom function) score's weight where one exists for the sample")
    normalize: str = opt("none", "none | batch: the model's scores centred and scaled to unit std over the step",
                         choices=RM_NORMALIZE)
    side: str = opt("train_side", "placement.mode = split: the ranks the reward model runs on (train_side; rollout_side is not "
                             "supported yet); colocated: every rank", choices=RM_SIDES)
    validate: bool = opt(True, "validation scores with the reward model too; false: by the rules alone (where the "
                               "model stands in for a rule, val/acc then measures the policy by that rule)")
    param_offload: bool = opt(False, "scorer: weights in host memory except during its forward (the judge's "
                                     "vLLM engine sleeps between steps)")
    judge: JudgeConfig = section(JudgeConfig, "kind = judge: the prompt, the verdict parser and the engine")

    def check(self, job) -> List[str]:
        if not self.enable:
            return []
        p = []
        if not self.path:
            p.append("reward.reward_model.path: empty, but reward.reward_model.enable is true")
        if self.weight == 0:
            p.append("reward.reward_model.weight = 0: the reward model would change nothing; set it != 0 "
                     "or reward.reward_model.enable=false")
        if self.side == "rollout_side":
            p.append("reward.reward_model.side = rollout_side is not supported yet; valid: train_side (the training "
                     "ranks, where the step scores its responses)")
        if self.kind == "judge":
            p += template_problems(self.judge.template)
            if self.judge.verdict == "pattern":
                p += pattern_problems(self.judge.pattern)
        return p

    def folder_problems(self, job) -> List[str]:
        """Checks that read the file system (validate(check_model=True), submit's pre-queue checks):
        the folder exists; a scorer's is a single-label *ForSequenceClassification model whose
        tokenizer is the policy's; a judge's is a causal LM whose yes/no tokens are one token each."""
        if not (self.enable and self.path):
            return []
        from verl_hpc.config.rm_folder import judge_folder_problems, scorer_folder_problems

        field = "reward.reward_model.path"
        if not Path(self.path).is_dir():
            return [f"{field}: no such folder '{self.path}'"]
        if self.kind == "scorer":
            return scorer_folder_problems(self.path, job.model.tokenizer_path or job.model.path,
                                          job.model.trust_remote_code)
        return judge_folder_problems(self.path, self.judge, job.model.trust_remote_code)


def template_problems(template: str) -> List[str]:
    """The judge template's placeholders: {response} required, only the three known."""
    import string

    field = "reward.reward_model.judge.template"
    try:
        parts = [(name, spec, conv) for _, name, spec, conv in string.Formatter().parse(template) if name is not None]
    except ValueError as e:
        return [f"{field}: not a format string ({e}); write braces as {{{{ and }}}}"]
    names = {name for name, _, _ in parts}
    p = []
    for name, spec, conv in parts:  # the values are text: {response:d} raises "Unknown format code 'd'" in the job
        if not (spec or conv) or name not in ("question", "response", "reference"):
            continue
        piece = f"{{{name}{'!' + conv if conv else ''}{':' + spec if spec else ''}}}"
        try:
            piece.format(**{name: "text"})
        except (ValueError, TypeError) as e:
            p.append(f"{field}: placeholder {piece} does not format a text ({e}); the judge inserts the prompt, "
                     f"response and reference as text: write {{{name}}}")
            break
    if "response" not in names:
        p.append(f"{field}: no {{response}} placeholder; the judge would never see the response it scores")
    unknown = sorted(names - {"question", "response", "reference"})
    if unknown:
        p.append(f"{field}: unknown placeholder(s) {', '.join('{' + n + '}' for n in unknown)}; valid: "
                 "{question}, {response}, {reference}")
    return p


def pattern_problems(pattern: str) -> List[str]:
    import re

    field = "reward.reward_model.judge.pattern"
    try:
        groups = re.compile(pattern).groups
    except re.error as e:
        return [f"{field}: not a regular expression ({e})"]
    return [] if groups >= 1 else [f"{field}: {pattern!r} has no group; the first group must capture the score"]


@dataclass
class RewardConfig(Section):
    custom_function: str = opt("", "\"package.module:function\"; needs safety.allow_custom_code")
    on_error: str = opt("zero", "a reward function that fails on one sample", choices=("zero", "raise"))
    gsm8k_method: str = opt("strict", "strict (\"#### 42\") | flexible (last number in the response)",
                            choices=("strict", "flexible"))
    timeout_s: float = opt(120.0, "seconds per reward call (run on a worker thread, so it holds for code that "
                           "ignores signals); a call past it follows on_error; 0 = no limit", check=f"[0, {WEEK_S}]")
    correct_at: float = opt(1.0, "an outcome score at or above this is a correct answer: validation's accuracy, "
                                 "the PRM's 0/1 label and algorithm.accuracy_filter read it")
    reward_model: RewardModelConfig = section(RewardModelConfig)

    def check(self, job) -> List[str]:
        p, fn = [], self.custom_function  # the opt-in is checked by safety: (SafetyConfig)
        module, _, name = fn.partition(":")
        if fn and not (module and name):
            p.append(f"reward.custom_function = '{fn}': expected 'package.module:function'")
        return p
