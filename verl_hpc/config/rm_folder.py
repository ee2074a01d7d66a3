"""Pre-queue checks of a reward model's folder (reward.reward_model.path), one line each.

A scorer is a single-label *ForSequenceClassification checkpoint (config.json names the class and
one label): its `score` head gives one number per sequence, read on the last token of the policy's
own token ids, so its tokenizer must be the policy's. A judge is a causal LM that reads text: any
tokenizer, but with verdict = yes_no its 'yes' and 'no' must be one token each (their next-token
log-probs are the verdict).
"""
from __future__ import annotations

from typing import List

from verl_hpc.config.errors import ConfigError
from verl_hpc.config.hf_model import read_hf_config

FIELD = "reward.reward_model.path"


def _architecture(path: str) -> tuple:
    data = read_hf_config(path, FIELD)
    arch = (data.get("architectures") or [""])[0] or data.get("model_type", "?")
    return data, arch


def scorer_folder_problems(path: str, policy_tokenizer: str, trust_remote_code: bool = False) -> List[str]:
    try:
        data, arch = _architecture(path)
    except ConfigError as e:
        return list(e.problems)
    if not arch.endswith("ForSequenceClassification"):
        return [f"{FIELD}: '{path}' is a {arch}, not a sequence-classification model; reward.reward_model.kind = "
                "scorer needs a *ForSequenceClassification checkpoint with one label (or kind = judge for a "
                "causal LM)"]
    labels = len(data.get("id2label") or {}) or int(data.get("num_labels", 2))
    if labels != 1:
        return [f"{FIELD}: '{path}' ({arch}) has {labels} labels; a scorer gives one number per response: "
                "valid: num_labels = 1"]
    head = scorer_head_problem(path)
    if head:
        return [head]
    from verl_hpc.config.sections.teacher import tokenizer_difference

    why = tokenizer_difference(policy_tokenizer, path, trust_remote_code) if policy_tokenizer else ""
    if why:
        return [f"{FIELD}: the scorer's tokenizer ({path}) is not the policy's (model.tokenizer_path: "
                f"{policy_tokenizer}): {why}; the scorer reads the policy's token ids"]
    return []


def judge_folder_problems(path: str, judge, trust_remote_code: bool = False) -> List[str]:
    """judge: the reward.reward_model.judge section."""
    try:
        data, arch = _architecture(path)
    except ConfigError as e:
        return list(e.problems)
    from verl_hpc.config.hf_model import is_vision_language

    if is_vision_language(data):  # the judge reads text; transformers' AutoModelForCausalLM has no class for it
        return [f"{FIELD}: '{path}' is a vision-language model ({arch}); reward.reward_model.kind = judge reads "
                "text and needs a causal LM (*ForCausalLM) that generates its verdict"]
    if not arch.endswith(("ForCausalLM", "ForConditionalGeneration")) or not (
            _causal_lm_class(arch) or data.get("auto_map")):
        return [f"{FIELD}: '{path}' is a {arch}; reward.reward_model.kind = judge needs a causal LM "
                "(*ForCausalLM) that generates its verdict"]
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception as e:  # noqa: BLE001 - any load failure is this folder's problem, on one line
        return [f"{FIELD}: the judge's tokenizer does not load from '{path}' ({type(e).__name__}: "
                f"{(str(e).splitlines() or [''])[0]})"]
    if judge.verdict != "yes_no":
        return []
    p = []
    for name in ("yes_token", "no_token"):
        text = getattr(judge, name)
        ids = tok.encode(text, add_special_tokens=False)
        if len(ids) != 1:
            p.append(f"reward.reward_model.judge.{name} = {text!r} is {len(ids)} tokens for the judge's tokenizer "
                     f"({path}); verdict = yes_no reads one token's log-prob: pick a text that is one token")
    return p


SCORE_NAME = "score.weight"  # the classifier's head: the reward is its output on the last token


def scorer_head_problem(path: str) -> str:
    """'' when the folder stores the scorer's head; else one line. A critic may start from a fresh
    head (it is trained), a frozen scorer may not: a seeded random head would score every response
    with noise and the policy would train on it without a word. Reads names only (index or
    safetensors headers)."""
    from verl_hpc.config.hf_model import stored_tensor_names

    try:
        names = stored_tensor_names(path, FIELD)
    except ConfigError as e:
        return str(e)
    if not names:
        return f"{FIELD}: '{path}' has no *.safetensors files; expected a Hugging Face model folder"
    if SCORE_NAME in names:
        return ""
    heads = sorted(n for n in names if not n.startswith(("model.", "transformer.")))[:3]
    return (f"{FIELD}: '{path}' stores no {SCORE_NAME} (the scorer's head; "
            f"{'it holds ' + ', '.join(heads) if heads else 'only backbone tensors'}): a frozen scorer would score "
            "with a random head; valid: a *ForSequenceClassification folder saved with its trained head")


def _causal_lm_class(arch: str) -> bool:
    """Whether transformers lists `arch` as a causal LM (what the judge engines build)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return arch in set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
