"""actor.share_prompts=on with a model the FSDP engine cannot pack exactly is refused before the
queue (the launcher's preflight of the model folders, which `submit` and `submit --dry-run` run), in the line the engine gives at build:
the field, the folder, the model type and why (sliding-window layers, a window, an architecture not
proven). On 85ec11b's successor it was refused only when the engine was built, in the job."""
import pytest

from arch_matrix import make_arch
from verl_hpc.config import ConfigError, load_config, validate
from verl_hpc.config.errors import raise_if_any
from verl_hpc.launcher.preflight import model_problems

# arch -> what the line must name: the model type and the cause
REFUSED = {"gemma2": "gemma2 has sliding_attention layers", "cohere2": "cohere2 has sliding_attention layers",
           "starcoder2_window": "starcoder2 attends within a sliding window (sliding_window = 6)",
           "gpt2": "gpt2 is not among the architectures whose attention is proven"}


FOLDERS = {}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    FOLDERS.update(_folders(tmp_path_factory))
    return FOLDERS


def _folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("share")  # whole folders: what the preflight reads
    out = {a: make_arch(root / a, a) for a in (*REFUSED, "starcoder2")}
    train = root / "train.jsonl"
    train.write_text('{"prompt": "2+2?", "data_source": "gsm8k", "ground_truth": "4"}\n' * 8)
    return {**out, "llama": make_arch(root / "llama", "llama"), "train": train}


def _validate(model, *extra, engine="fsdp"):
    cfg = load_config(None, [f"model.path={model}", f"parallel.engine={engine}", "rollout.n=2",
                             "data.max_prompt_length=64", "data.max_response_length=64",
                             f"data.train_files=[{FOLDERS['train']}]", *extra])
    validate(cfg)
    raise_if_any(model_problems(cfg))


@pytest.mark.parametrize("arch", list(REFUSED))
def test_share_prompts_on_is_refused_before_the_queue_where_the_engine_cannot_pack(folders, arch):
    with pytest.raises(ConfigError) as e:
        _validate(folders[arch], "actor.share_prompts=on")
    assert len(e.value.problems) == 1 and "\n" not in str(e.value), e.value
    assert str(e.value).startswith(f"actor.share_prompts=on: cannot pack prompts for model.path '{folders[arch]}': "
                                   f"{REFUSED[arch]}"), e.value
    assert str(e.value).endswith("; valid: auto (packs where exact) or off")
    for share in ("auto", "off"):  # auto runs it one sequence per row
        _validate(folders[arch], f"actor.share_prompts={share}")


def test_proven_architectures_and_other_roles_engines_pass(folders):
    for arch in ("llama", "starcoder2"):  # starcoder2 without a window is plain causal attention
        _validate(folders[arch], "actor.share_prompts=on")
    # Megatron packs through its own segmented attention: its rules are checked where it builds
    _validate(folders["llama"], "actor.share_prompts=on", engine="megatron")


def test_a_teacher_the_fsdp_engine_runs_is_checked_too(folders):
    teacher = ["teacher.enable=true", f"teacher.model_path={folders['gemma2']}", "actor.share_prompts=on"]
    with pytest.raises(ConfigError) as e:
        _validate(folders["llama"], *teacher, "teacher.engine=fsdp")
    assert f"cannot pack prompts for teacher.model_path '{folders['gemma2']}': gemma2 has sliding" in str(e.value)
