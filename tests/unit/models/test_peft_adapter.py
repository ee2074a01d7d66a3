"""lora.init_from against the job (verl_hpc/models/peft_adapter.py): adapters written by stock PEFT
with options the engine does not compute are refused with one line naming the option, as are
damaged files, NaN values and tensors the adapter would not use; the submitter's preflight makes
these refusals before the queue."""
import json
import shutil

import pytest
import torch

import lora_reference
from lora_reference import HF_TARGETS

RANK, ALPHA = 4, 8.0
TARGETS = tuple(HF_TARGETS)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    from verl_hpc.models.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("peft_base") / "model", "llama", layers=2)


def save_peft(base, folder, targets=TARGETS, **options):
    return lora_reference.save_peft(base, folder, RANK, options.pop("lora_alpha", ALPHA), targets, **options)


def check(base, folder, *, values=True, **job):
    from verl_hpc.models.config_mapping import load_arch
    from verl_hpc.models.lora import AdapterSpec
    from verl_hpc.models.peft_adapter import check_adapter

    spec = AdapterSpec(rank=job.get("rank", RANK), alpha=job.get("alpha", ALPHA), dropout=0.0,
                       targets=job.get("targets", TARGETS), init="kaiming", use_rslora=job.get("use_rslora", False))
    return check_adapter(folder, spec, load_arch(base), values=values)


@pytest.fixture(scope="module")
def stock(base, tmp_path_factory):
    return save_peft(base, tmp_path_factory.mktemp("stock") / "adapter")


def test_a_stock_peft_adapter_is_accepted_with_one_a_per_module(base, stock):
    found = check(base, stock)
    assert found.ok, (found.problems, found.damaged)
    assert found.per_module_a is True  # its q/k/v A differ: the fused layers hold one A per module


@pytest.mark.parametrize("options, words", [
    (dict(use_dora=True), "use_dora = true (DoRA"),
    (dict(rank_pattern={"q_proj": 2}), "rank_pattern = {'q_proj': 2} gives some modules another r"),
    (dict(alpha_pattern={"v_proj": 32}), "alpha_pattern = {'v_proj': 32} gives some modules another lora_alpha"),
    (dict(use_rslora=True), "use_rslora = true (scale alpha / sqrt(r)), this job has lora.use_rslora = false: "
                            "set lora.use_rslora = true"),
    (dict(lora_alpha=16), "lora_alpha = 16, this job has lora.alpha = 8.0"),
    (dict(bias="lora_only"), "bias = 'lora_only': the engine does not compute this option"),
])
def test_options_the_engine_does_not_compute_are_refused_naming_them(base, tmp_path, options, words):
    found = check(base, save_peft(base, tmp_path / "a", **options))
    lines = found.problems + found.damaged
    assert lines and all(p.startswith("lora.init_from: '") and "\n" not in p for p in lines), lines
    assert any(words in p for p in lines), lines


def test_rslora_agrees_when_the_job_says_so(base, tmp_path):
    assert check(base, save_peft(base, tmp_path / "a", use_rslora=True), use_rslora=True).ok


def test_targets_rank_and_fused_parts(base, tmp_path):
    attn = save_peft(base, tmp_path / "attn", targets=("linear_qkv", "linear_proj"))
    found = check(base, attn)
    assert found.problems == [f"lora.init_from: '{attn / 'adapter_config.json'}': target_modules select ['k_proj', "
                              "'o_proj', 'q_proj', 'v_proj'], this job has lora.target_modules = ['linear_qkv', "
                              "'linear_proj', 'linear_fc1', 'linear_fc2']: set lora.target_modules = "
                              "['linear_qkv', 'linear_proj']"]
    assert check(base, attn, rank=8).problems[0].endswith("r = 4, this job has lora.rank = 8: set lora.rank = 4")
    cfg = json.loads((attn / "adapter_config.json").read_text())
    cfg["target_modules"] = ["q_proj", "v_proj"]
    (attn / "adapter_config.json").write_text(json.dumps(cfg))
    assert "select q_proj, v_proj without k_proj: Megatron fuses them" in check(base, attn).problems[0]


def _weights(folder, tmp_path, change):
    from safetensors.torch import load_file, save_file

    out = tmp_path / "changed"
    shutil.copytree(folder, out)
    tensors = load_file(str(out / "adapter_model.safetensors"))
    change(tensors)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    return out


def test_unused_missing_misshapen_and_nan_tensors_are_named(base, stock, tmp_path):
    q_a = "base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight"
    lm_head = "base_model.model.lm_head.lora_A.weight"
    extra = _weights(stock, tmp_path / "x", lambda t: t.update({lm_head: t[q_a].clone()}))
    assert check(base, extra).problems == [
        f"lora.init_from: '{extra / 'adapter_model.safetensors'}' holds tensor 'base_model.model.lm_head.lora_A.weight'"
        ", which the job's adapter does not use (another module, a bias, modules_to_save, DoRA's magnitude?); "
        "valid: lora_A and lora_B of the targeted modules only"]
    gone = _weights(stock, tmp_path / "g", lambda t: t.pop(q_a))
    assert f"has no tensor '{q_a}'" in check(base, gone).problems[0]
    wide = _weights(stock, tmp_path / "w", lambda t: t.update({q_a: torch.zeros(RANK + 1, t[q_a].shape[1])}))
    assert f"tensor '{q_a}' has shape [5, 128]; lora.rank and the base's config.json imply [4, 128]" in \
        check(base, wide).problems[0]

    def poison(t):
        t[q_a][0, 3] = float("nan")

    nan = _weights(stock, tmp_path / "n", poison)
    assert check(base, nan, values=False).ok  # headers only (a rank's early check): values come at load
    assert check(base, nan).damaged == [f"lora.init_from: '{nan / 'adapter_model.safetensors'}': tensor '{q_a}' holds "
                                        "NaN or inf; valid: finite values (the adapter diverged or was damaged: start "
                                        "from an earlier one)"]


@pytest.mark.parametrize("damage", ["truncate", "header"])
def test_a_damaged_weights_file_is_one_line_naming_it(base, stock, tmp_path, damage):
    bad = tmp_path / "bad"
    shutil.copytree(stock, bad)
    f = bad / "adapter_model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[:-100] if damage == "truncate" else data[:8] + b"{" * 16 + data[24:])
    found = check(base, bad)
    assert len(found.damaged) == 1 and found.damaged[0].startswith(f"lora.init_from: '{f}' is not a readable "
                                                                   "safetensors file (")
    assert found.damaged[0].endswith("truncated or damaged; valid: the adapter_model.safetensors PEFT writes")


def test_the_submitter_refuses_before_the_queue(base, tmp_path):
    """submit's preflight: an rsLoRA adapter into a job without lora.use_rslora, and a DoRA one, each
    one line; the same job with lora.use_rslora=true passes."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from verl_hpc.config import ConfigError, load_config
    from verl_hpc.launcher.preflight import preflight

    row = {"prompt": "2+2?", "data_source": "gsm8k", "ground_truth": "4"}
    train = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist([row] * 8), train)
    rs = save_peft(base, tmp_path / "rs", use_rslora=True)
    job = [f"model.path={base}", f"data.train_files=[{train}]", f"trainer.output_dir={tmp_path}/out",
           f"slurm.log_dir={tmp_path}/logs", "rollout.n=2", "lora.rank=4", "lora.alpha=8", f"lora.init_from={rs}"]
    with pytest.raises(ConfigError) as e:
        preflight(load_config(None, job))
    assert e.value.problems == [f"lora.init_from: '{rs / 'adapter_config.json'}': use_rslora = true (scale alpha / "
                                "sqrt(r)), this job has lora.use_rslora = false: set lora.use_rslora = true"]
    preflight(load_config(None, [*job, "lora.use_rslora=true"]))


def test_a_rank_checks_the_adapter_before_building_anything(base, stock, tmp_path):
    """job.check_weight_files, before vLLM and the engines are built (a job started without the
    submitter's checks): an adapter of another alpha is one ConfigError line, a cut file one
    WeightFileError line; the values wait for the engine's load (it reads them once)."""
    from verl_hpc.config import ConfigError, load_config
    from verl_hpc.job import check_weight_files
    from verl_hpc.models.hf_checkpoint import WeightFileError

    job = [f"model.path={base}", "lora.rank=4", f"lora.init_from={stock}"]
    check_weight_files(load_config(None, [*job, "lora.alpha=8"]))
    with pytest.raises(ConfigError, match=r"^lora.init_from: .*: lora_alpha = 8.0, this job has lora.alpha = 32.0 "):
        check_weight_files(load_config(None, job))
    cut = tmp_path / "cut"
    shutil.copytree(stock, cut)
    (cut / "adapter_model.safetensors").write_bytes((cut / "adapter_model.safetensors").read_bytes()[:-8])
    with pytest.raises(WeightFileError, match="is not a readable safetensors file"):
        check_weight_files(load_config(None, [f"model.path={base}", "lora.rank=4", "lora.alpha=8",
                                              f"lora.init_from={cut}"]))
