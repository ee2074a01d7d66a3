"""Megatron DDP's overlapped gradient reduce, the GPU default, run for real on gloo at dp 1: the same
weights as without it after two steps (its data-parallel 2 run, with the distributed optimizer's
overlapped parameter gather, is tests/dist/engines/test_eng_overlap.py)."""
import dataclasses

import torch


def _train(model_path, overlap: bool):
    from verl_hpc.engines.megatron import MegatronEngine
    from verl_hpc.engines.megatron.kernels import KernelSwitches
    from verl_hpc.gpu_check import workload

    opts = workload.train_options(model_path, "float32", use_distributed_optimizer=True)
    eng = MegatronEngine(dataclasses.replace(opts, kernels=KernelSwitches(overlap_grad_reduce=overlap,
                                                                          overlap_param_gather=False)))
    assert eng.perf.overlap_grad_reduce is overlap
    for seed in (1, 2):
        eng.train_step(workload.batch(seed), workload.loss_fn)
    return [p.detach().clone() for p in eng._parameters()]


def test_overlap_grad_reduce_trains_the_same_weights_at_dp1(one_rank_world, tmp_path):
    from verl_hpc.models.tiny import make_tiny_model
    from verl_hpc.parallel import init_model_parallel

    model = str(make_tiny_model(tmp_path / "model", "llama", layers=2))
    init_model_parallel(1, 1)
    plain, overlapped = _train(model, False), _train(model, True)
    assert len(plain) == len(overlapped) > 0
    assert all(torch.equal(a, b) for a, b in zip(plain, overlapped))
