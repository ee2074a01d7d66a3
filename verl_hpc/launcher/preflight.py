"""What can be checked on a login node before a job waits in the queue (`submit`, `--dry-run`).

The config checks (verl_hpc/config/validate.py) look at values; these look at the files the
values name, so that a bad data row, a truncated safetensors file or a config.json that disagrees
with its weights fails here in seconds instead of after hours in the queue. One line per problem,
naming the field, the file and the row or tensor, and what is valid:

- data files (data.train_files/val_files or data.tasks for RL, data.sft_files for SFT): every row,
  streamed, through the job's own row, reward-routing and prompt-length rules (preflight_data.py),
  and data.train_batch_size against the rows the train set keeps;
- model folders (model.path, critic.model_path, prm.model_path, reward.reward_model.path, the
  distillation teachers' teacher.model_path / teacher.by_data_source): config.json names a
  supported architecture, each *.safetensors header is readable and its tensors end exactly at
  the end of the file, an index's weight_map names files that exist, and the tensors' names and
  shapes are those config.json implies; the tokenizer loads and its ids fit the vocabulary
  (preflight_model.py); a PRIME PRM folder's tokenizer is the actor's (it scores the actor's token
  ids) and its vocabulary covers them;
- with rollout.engine=vllm, that vLLM loads the policy's folder (rollout/vllm/support.py: for an
  architecture outside the Megatron mapping vLLM itself is asked whether its model has a place for
  every stored tensor), one line naming the first tensors it has none for and the ways out;
- rollout.quantization / kv_cache_dtype: offered by the installed vLLM, quantizing something of the
  model, and running on this machine where it is the job's kind (rollout/vllm/quantization.py);
- the LoRA adapter folder lora.init_from: its config against the lora section (r, alpha,
  use_rslora, targets; DoRA, rank/alpha patterns and other options the engine does not compute are
  refused), its tensors' names, shapes and dtypes against the base, and their values (NaN / inf)
  (preflight_model.py, models/peft_adapter.py);
- agent.enable: agent.read_only_paths exist here, agent.function's module is found and compiles
  (found without running it: rewards/custom.py module_problem, which every rank asks too);
- output folders (trainer.output_dir, checkpoint.dir, slurm.log_dir up to its first %): a
  directory (not a file) this user can write, or creatable under one;
- `latest` in checkpoint.dir (and in trainer.resume when it is a folder) names a checkpoint inside
  that folder, never a path out of it.
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import List

from verl_hpc.config import ConfigError
from verl_hpc.config.errors import raise_if_any
from verl_hpc.config.sections.fsdp import MEGATRON
from verl_hpc.launcher.preflight_data import data_problems
from verl_hpc.launcher.preflight_model import (init_from_check, load_tokenizer, prm_problems, read_header,
                                               tensors_of, vocab_problem, weights_problems)

_STEP_NAME = re.compile(r"^step_\d+$")


def preflight(cfg, check_model: bool = True) -> None:
    """Raise one ConfigError listing every problem found in the files the config names."""
    problems, tokenizer = [], None
    if check_model:
        problems += model_problems(cfg)
        problems += [] if problems else rollout_engine_problems(cfg)  # vLLM reads only well-formed folders
        problems += [] if problems else quantization_problems(cfg)
        adapter = init_from_check(cfg, values=True)
        problems += (adapter.damaged + adapter.problems) if adapter is not None else []
        if cfg.trainer.job in ("rl", "sft") and cfg.model.path:
            tokenizer, found = load_tokenizer(cfg)
            problems += found + (vocab_problem(tokenizer, cfg) + prm_problems(cfg, tokenizer)
                                 if tokenizer is not None else [])
    raise_if_any(data_problems(cfg, tokenizer) + problems + agent_problems(cfg) + _outputs(cfg) + _resume(cfg))


# ------------------------------------------------------------------------------ agents
def agent_problems(cfg) -> List[str]:
    """agent.enable: what each rank refuses when it starts the agents, asked here with the same
    checks (no user code runs on the login node): agent.read_only_paths exist on this node, and
    agent.function's module is found (slurm.env's PYTHONPATH searched first) and compiles."""
    a = cfg.agent
    if not a.enable:
        return []
    from verl_hpc.config.sections.agent import read_only_problems

    problems = read_only_problems(a.read_only_paths)
    if a.function and cfg.safety.allow_custom_code:
        from verl_hpc.rewards.custom import module_problem

        extra = [p for p in str(cfg.slurm.env.get("PYTHONPATH", "")).split(os.pathsep) if p]
        problems += [p for p in [module_problem("agent.function", a.function, extra)] if p]
    return problems


# ------------------------------------------------------------------------------ models
def model_problems(cfg) -> List[str]:
    """The model folders' files (headers only): what a rank checks again before it builds anything.
    A folder whose role the FSDP engine trains (parallel.engine) is checked as transformers loads
    it, not against Megatron's weight rules."""
    from verl_hpc.config.sections.fsdp import choose_engine

    problems = []
    for field, path in _model_folders(cfg):
        try:
            if not Path(path).is_dir():
                engine = MEGATRON
            elif field.startswith("teacher."):  # the teacher has an engine of its own (teacher.engine)
                engine = cfg.teacher.engine_for(cfg)
            else:
                engine = choose_engine(cfg.parallel.engine, path, cfg.parallel, field)
        except ConfigError as e:
            problems += e.problems
            continue
        problems += model_folder_problems(path, field, engine=engine,
                                          trust_remote_code=cfg.model.trust_remote_code)
        problems += share_prompts_problems(cfg, path, field, engine)
    return problems


def share_prompts_problems(cfg, path: str, field: str, engine: str) -> List[str]:
    """actor.share_prompts=on for a language-model role the FSDP engine runs (the actor and reference,
    the PRM, a teacher) whose model it could not pack exactly: the engine's refusal, before the queue."""
    if cfg.actor.share_prompts != "on" or field == "critic.model_path":  # a value head never packs
        return []
    if field.startswith("teacher."):  # the teacher's own engine (teacher.engine)
        engine = cfg.teacher.engine_for(cfg)
    if engine != "fsdp":
        return []
    from verl_hpc.engines.fsdp.sharing import share_prompts_problems as refused

    return refused(path, field, cfg.model.trust_remote_code)


def rollout_engine_problems(cfg) -> List[str]:
    """rollout.engine=vllm: whether vLLM serves the policy's folder here (auto asks in the job, and
    falls back to HF generate with the reason in the log). Where vLLM is not installed on this
    machine the job says so (factory.VLLM_MISSING): a login node may lack it."""
    from verl_hpc.rollout.factory import vllm_available

    if cfg.trainer.job != "rl" or cfg.rollout.engine != "vllm" or not cfg.model.path or not vllm_available():
        return []
    from verl_hpc.rollout.vllm.support import check_vllm_serves

    try:
        check_vllm_serves(cfg.model.path, split=cfg.placement.split)
    except ConfigError as e:
        return e.problems
    return []


def quantization_problems(cfg) -> List[str]:
    """rollout.quantization / kv_cache_dtype: a method the installed vLLM offers, one that quantizes
    something of this model, and, where this machine is the kind the job runs on (a CPU job on a
    CPU node, a GPU job on a GPU node), one that runs here: asked of vLLM by running it
    (rollout/vllm/quantization.py; cached). A GPU job submitted from a CPU login node is checked
    for the rest here and for its device by the rank, which refuses by name the same way."""
    from verl_hpc.rollout.factory import vllm_available

    r = cfg.rollout
    if cfg.trainer.job != "rl" or r.engine == "hf" or not vllm_available() or (
            not r.quantized and r.kv_cache_dtype == "auto"):
        return []
    from verl_hpc.rollout.vllm.quantization import problems
    from verl_hpc.runtime.device import has_gpu

    return problems(r.quantization, r.kv_cache_dtype, cfg.model.path,
                    here=(cfg.slurm.gpus_per_node > 0) == has_gpu())


def _model_folders(cfg):
    out = [("model.path", cfg.model.path)] if cfg.model.path else []
    if cfg.critic.wanted(cfg) and cfg.critic.model_path and cfg.critic.model_path != cfg.model.path:
        out.append(("critic.model_path", cfg.critic.model_path))
    prm = cfg.prm.model_path
    if cfg.trainer.job == "rl" and cfg.prm.wanted(cfg) and prm and prm != cfg.model.path:
        out.append(("prm.model_path", prm))
    if cfg.reward.reward_model.enable and cfg.reward.reward_model.path:
        out.append(("reward.reward_model.path", cfg.reward.reward_model.path))
    if cfg.trainer.job == "rl" and cfg.teacher.enable:  # each distillation teacher's files (its tokenizer: validate)
        out += [(f, p) for f, p in cfg.teacher.folders().items() if p != cfg.model.path]
    return out


def model_folder_problems(path: str, field: str, engine: str = MEGATRON,
                          trust_remote_code: bool = False) -> List[str]:
    folder = Path(path)
    if not folder.is_dir():
        return []  # validate() already says so
    problems = []
    if engine == "fsdp":
        config_problems = transformers_config_problems(folder, field, trust_remote_code)
        problems += config_problems
    elif field != "reward.reward_model.path":  # a reward model may be any sequence classifier
        from verl_hpc.models.config_mapping import load_hf_config, parse_hf_config

        try:
            parse_hf_config(load_hf_config(folder), str(folder / "config.json"))
        except ConfigError as e:
            problems.append(f"{field}: {e}")
    weights = sorted(folder.glob("*.safetensors"))
    if not weights:
        problems.append(f"{field}: '{folder}' has no *.safetensors files; expected a Hugging Face model folder")
    headers = {}
    for f in weights:
        header, problem = read_header(f)
        if problem:
            problems.append(f"{field}: {problem}")
        headers[f] = header
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = set(json.loads(index.read_text())["weight_map"].values())
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            problems.append(f"{field}: '{index}' is not a safetensors index (a JSON object with weight_map): {e}")
        else:
            gone = sorted(n for n in names if not (folder / n).is_file())
            if gone:
                problems.append(f"{field}: '{index}' names missing file(s): {', '.join(gone)}")
    # a vision-language model's folder is checked as transformers builds it on either engine: its tower is
    # transformers' module on the Megatron engine too (models/vlm.py), which the text rules do not cover
    whole = engine == "fsdp" or _vision_language(folder)
    if not whole and field != "reward.reward_model.path" and weights and not problems:
        problems += weights_problems(folder, field, tensors_of(headers), value_head=field == "critic.model_path")
    if whole and weights and not problems:
        problems += transformers_weights_problems(folder, field, trust_remote_code, tensors_of(headers))
    return problems


VALUE_FIELDS = ("critic.model_path", "reward.reward_model.path")  # a value head on the folder's backbone


def _vision_language(folder: Path) -> bool:
    from verl_hpc.config.hf_model import is_vision_language, read_hf_config

    try:
        return is_vision_language(read_hf_config(folder))
    except ConfigError:
        return False  # the config check above reports it


def transformers_weights_problems(folder: Path, field: str, trust_remote_code: bool, found) -> List[str]:
    """The FSDP engine's folder rules (engines/fsdp/folder_check.py): a policy-like role's folder
    is a causal LM, and the stored shapes are those of the model transformers builds."""
    from verl_hpc.engines.fsdp.build import _auto_class, hf_config
    from verl_hpc.engines.fsdp.folder_check import causal_lm_problem, shape_problems

    try:
        config = hf_config(str(folder), trust_remote_code, field)
        value = field in VALUE_FIELDS
        problem = "" if value else causal_lm_problem(config, field, str(folder))
        if problem:
            return [problem]
        shapes = {n: (shape, file) for n, (shape, _, file) in found.items()}
        if value:  # the backbone (AutoModel) names its tensors without the classifier's "model." prefix
            shapes = {n[len("model."):]: v for n, v in shapes.items() if n.startswith("model.")}
        return shape_problems(config, _auto_class("value" if value else "lm", config), field, folder, shapes,
                              trust_remote_code)
    except ConfigError as e:
        return e.problems


def transformers_config_problems(folder: Path, field: str, trust_remote_code: bool) -> List[str]:
    """Whether transformers can build the folder's model (what the FSDP engine loads): its
    config.json through AutoConfig, one line naming the folder and the architecture otherwise."""
    try:
        from verl_hpc.engines.fsdp.build import hf_config

        hf_config(str(folder), trust_remote_code, field)
    except ConfigError as e:
        return e.problems
    return []


# ------------------------------------------------------------------------------ outputs
def _outputs(cfg) -> List[str]:
    log_dir = cfg.slurm.log_dir.split("%", 1)[0]  # %j and friends are filled in by Slurm
    return _dir_problems(_output_dirs(cfg) + ([("slurm.log_dir", log_dir)] if log_dir else []))


def output_problems(cfg) -> List[str]:
    """trainer.output_dir and checkpoint.dir: writable folders, or creatable. Also what every rank
    checks first (job.py), before it builds a model: a job started without these checks (a
    hand-written sbatch script, --skip-file-checks) fails there in one line, not with an OSError
    from the metrics file after minutes of start-up."""
    return _dir_problems(_output_dirs(cfg))


def _output_dirs(cfg) -> List[tuple]:
    t = cfg.trainer
    return [("trainer.output_dir", t.output_dir),
            ("checkpoint.dir", cfg.checkpoint.dir or os.path.join(t.output_dir, "checkpoints"))]


def _dir_problems(dirs) -> List[str]:
    """One line per folder at fault: checkpoint.dir and slurm.log_dir inside a trainer.output_dir
    that cannot be written have that folder's problem, which is said once, under the first field."""
    problems, said = [], set()
    for field, d in dirs:
        probe = _nearest_existing(Path(d).absolute())
        if probe not in said and (p := writable_dir_problem(d, field)):
            problems.append(p)
            said.add(probe)
    return problems


def _nearest_existing(p: Path) -> Path:
    """p, or its nearest existing ancestor: the folder that decides whether p can be created."""
    while not p.exists():
        p = p.parent
    return p


def writable_dir_problem(path: str, field: str) -> str:
    p = Path(path).absolute()
    probe = _nearest_existing(p)
    if not probe.is_dir():
        return (f"{field}: '{probe}' is a file, not a folder" + (f" (needed to create '{p}')" if probe != p else "")
                + "; valid: a writable folder or a path that can be created")
    if not os.access(probe, os.W_OK | os.X_OK):
        return f"{field}: '{probe}' is not writable by this user; valid: a writable folder"
    return ""


# ------------------------------------------------------------------------------ resume
def _resume(cfg) -> List[str]:
    roots = [("checkpoint.dir", cfg.checkpoint.dir or os.path.join(cfg.trainer.output_dir, "checkpoints"))]
    if cfg.trainer.resume not in ("auto", "never") and Path(cfg.trainer.resume).is_dir():
        roots.append(("trainer.resume", cfg.trainer.resume))
    return [p for field, root in roots if (p := latest_problem(Path(root), field))]


def latest_problem(root: Path, field: str) -> str:
    """'' or why `root/latest` does not name a checkpoint folder inside `root`."""
    from verl_hpc.checkpoint.index import INDEX, LATEST

    latest = root / LATEST
    if not latest.exists():
        return ""
    if not latest.is_file():
        return f"{field}: '{latest}' is not a file; expected a one-line file naming a step_NNNNNN folder"
    name = latest.read_text(errors="replace").strip()
    if not _STEP_NAME.match(name):
        return (f"{field}: '{latest}' names {name!r}; valid: a step_NNNNNN folder inside '{root}' "
                "(no path, no '..')")
    if not (root / name / INDEX).is_file():
        return f"{field}: '{latest}' names {name!r}, which is missing or incomplete (no {INDEX})"
    return ""
