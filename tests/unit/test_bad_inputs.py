"""Bad inputs a new user sends (issue 11), each answered with one line naming the field, file or
row and what is valid: config integers, values that would reach the sbatch script, data bytes."""
import os
import time
from pathlib import Path

import pytest

from verl_hpc.config import ConfigError, load_config, validate
from verl_hpc.data.errors import DataError
from verl_hpc.data.records import load_records, read_rows

pytestmark = pytest.mark.unit
OK = ["model.path=/m", "data.train_files=[t.parquet]", "rollout.n=2"]


def one_line(exc) -> str:
    text = str(exc)
    assert "\n" not in text and "Traceback" not in text, text
    return text


# ------------------------------------------------------------------ integers that are not decimal
@pytest.mark.parametrize("override,shown", [
    ("trainer.total_steps=0x10", "'0x10'"),
    ("data.train_batch_size=0o10", "'0o10'"),
    ("slurm.time_min=1:30", "'1:30'"),  # YAML 1.1 sexagesimal: 90
    ("rollout.n=0b11", "'0b11'"),
])
def test_non_decimal_int_on_the_command_line_is_an_error(override, shown):
    with pytest.raises(ConfigError) as e:
        load_config(None, OK + [override])
    key = override.split("=")[0]
    assert one_line(e.value).startswith(f"{key}: expected int, got {shown}"), e.value


def test_non_decimal_int_in_a_file_names_the_line(tmp_path):
    f = tmp_path / "job.yaml"
    f.write_text("trainer:\n  total_steps: 0x10\n")
    with pytest.raises(ConfigError) as e:
        load_config(f, [])
    assert one_line(e.value) == (f"trainer.total_steps: expected int, got '0x10' (from {f}, line 2)"), e.value


def test_decimal_ints_and_hex_text_in_str_fields_still_load():
    cfg = load_config(None, ["trainer.total_steps=1_000", "trainer.experiment_name=0x10"])
    assert cfg.trainer.total_steps == 1000 and cfg.trainer.experiment_name == "0x10"


# ------------------------------------------------------------------ values that reach the sbatch script
# YAML double quotes turn \\n into a newline (single quotes would fold a raw newline into a space)
@pytest.mark.parametrize("override,message", [
    ('slurm.additional.comment="x\\n#SBATCH --uid=0"',
     "slurm.additional.comment: contains character '\\n'; valid: a one-line value"),
    ('slurm.additional={"mail-type\\n#SBATCH --uid": 0}',
     "slurm.additional: 'mail-type\\n#SBATCH --uid' is not an sbatch option name"),
    ('slurm.env.FOO="a\\nrm -rf ~"', "slurm.env.FOO: contains character '\\n'; valid: a one-line value"),
    ("slurm.env={'A B': x}", "slurm.env: 'A B' is not an environment variable name"),
    ("slurm.env={'1X': x}", "slurm.env: '1X' is not an environment variable name"),
    ('slurm.setup=["module load x\\r#SBATCH --exclusive"]', "slurm.setup[0]: contains character '\\r'"),
    ('slurm.partition="gpu\\n#SBATCH --qos=high"', "slurm.partition: contains character '\\n'"),
    ('slurm.job_name="a\\x1b[2Jb"', "slurm.job_name: contains character '\\x1b'"),
    ('slurm.container.mounts=["/a:/a\\n/b"]', "slurm.container.mounts[0]: contains character '\\n'"),
])
def test_sbatch_injection_is_refused(override, message):
    cfg = load_config(None, OK + [override])
    with pytest.raises(ConfigError) as e:
        validate(cfg, check_model=False)
    assert len(e.value.problems) == 1 and one_line(e.value).startswith(message), e.value


# ------------------------------------------------------------------ data bytes
def test_non_utf8_jsonl_names_file_and_line(tmp_path):
    f = tmp_path / "train.jsonl"
    f.write_bytes(b'{"prompt": "a", "data_source": "gsm8k", "ground_truth": "1"}\n\n'
                  b'{"prompt": "caf\xe9", "data_source": "gsm8k", "ground_truth": "1"}\n')
    for read in (lambda: read_rows(str(f)), lambda: load_records([str(f)])):
        with pytest.raises(DataError) as e:
            read()
        assert one_line(e.value).endswith(f" file '{f}' line 3: byte 0xe9 at column 16 is not UTF-8; JSONL files "
                                     "must be UTF-8 text (re-save the file as UTF-8)"), e.value


# ------------------------------------------------------------------ the local failure summary
def test_local_failure_summary_puts_the_rank_that_died_first_first(tmp_path):
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from verl_hpc.launcher.local import by_time_of_death

    now = time.time()
    for rank, died, in ((0, now - 1), (1, now - 5), (2, now - 3)):  # rank 1 died first
        log = tmp_path / "run1" / "attempt_0" / str(rank) / "stderr.log"
        log.parent.mkdir(parents=True)
        log.write_text("...")
        os.utime(log, (died, died))
    failures = {r: ProcessFailure(local_rank=r, pid=100 + r, exitcode=code, error_file=str(tmp_path / "none"))
                for r, code in ((0, 1), (1, 3), (2, -15))}
    assert by_time_of_death(failures, Path(tmp_path)) == [1, 2, 0]
