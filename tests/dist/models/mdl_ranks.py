"""Spawn gloo ranks that run a model scenario under the project's runtime, and the scenarios.

`launch(n, scenario, args, workdir)` starts n copies of this file with torchrun-style variables
(RANK, WORLD_SIZE, MASTER_ADDR/PORT), so `verl_hpc.runtime.bootstrap()` brings each rank up as
in a real job; each rank writes `rank{r}.json` and the results come back as a list. A failing
rank fails the launch with every rank's log tail.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(world_size: int, scenario: str, args: dict, workdir: Path, timeout: float = 300):
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "args.json").write_text(json.dumps(args))
    port, procs = _free_port(), []
    for rank in range(world_size):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                   LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1", VERL_HPC_LOGLEVEL="WARNING",
                   PYTHONPATH=str(REPO))
        log = open(workdir / f"rank{rank}.log", "w")
        procs.append((subprocess.Popen([sys.executable, __file__, scenario, str(workdir)], cwd=REPO,
                                       env=env, stdout=log, stderr=subprocess.STDOUT), log))
    deadline, failed = time.time() + timeout, False
    for proc, log in procs:
        try:
            failed |= proc.wait(timeout=max(1.0, deadline - time.time())) != 0
        except subprocess.TimeoutExpired:
            failed = True
        log.close()
    for proc, _ in procs:  # only our own children, by handle
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if failed:
        tails = [f"--- rank {r} (rc {p.returncode}) ---\n" + (workdir / f"rank{r}.log").read_text()[-4000:]
                 for r, (p, _) in enumerate(procs)]
        raise AssertionError(f"{scenario} on {world_size} ranks failed:\n" + "\n".join(tails))
    return [json.loads((workdir / f"rank{r}.json").read_text()) for r in range(world_size)]


# ----------------------------------------------------------------------------- rank side


def _forward(model, ids):
    """Logits through Megatron's own schedule (pipelined with p2p when pp > 1); None off the
    last stage. Exercises the schedule/p2p CPU help, not only the model."""
    import torch
    from megatron.core.pipeline_parallel import get_forward_backward_func

    captured = []
    pos = torch.arange(ids.shape[1]).unsqueeze(0).expand_as(ids)

    def loss_func(output):
        captured.append(output.detach())
        return output.sum() * 0.0, {}

    def step(data_iterator, m):
        batch = next(data_iterator)
        return m(batch, pos, None), loss_func

    with torch.no_grad():
        get_forward_backward_func()(
            forward_step_func=step, data_iterator=iter([ids]), model=[model], num_microbatches=1,
            seq_length=ids.shape[1], micro_batch_size=ids.shape[0], forward_only=True)
    return captured[0] if captured else None


def _spy_safe_open(record):
    """Wrap safetensors.safe_open so every read is recorded as (name, shape read, full shape)."""
    import safetensors

    real = safetensors.safe_open

    class Slice:
        def __init__(self, name, inner):
            self.name, self.inner = name, inner

        def __getattr__(self, attr):
            return getattr(self.inner, attr)

        def __getitem__(self, index):
            t = self.inner[index]
            record.append((self.name, list(t.shape), list(self.inner.get_shape())))
            return t

    class Handle:
        def __init__(self, *a, **kw):
            self.inner = real(*a, **kw)

        def __enter__(self):
            self.inner.__enter__()
            return self

        def __exit__(self, *exc):
            return self.inner.__exit__(*exc)

        def keys(self):
            return self.inner.keys()

        def get_slice(self, name):
            return Slice(name, self.inner.get_slice(name))

        def get_tensor(self, name):
            t = self.inner.get_tensor(name)
            record.append((name, list(t.shape), list(t.shape)))
            return t

    safetensors.safe_open = Handle


def _check_model(spec: dict, mp, out: dict) -> None:
    import torch
    from safetensors.torch import load_file

    from verl_hpc.models import build_gpt_model, export_hf_weights, load_arch, load_hf_weights
    from verl_hpc.models.gpt import full_vocab_logits

    folder = Path(spec["dir"])
    arch = load_arch(folder)
    import safetensors

    reads, real_safe_open = [], safetensors.safe_open
    if spec.get("spy"):
        _spy_safe_open(reads)
    model = build_gpt_model(arch)
    try:
        report = load_hf_weights(model, folder)
    finally:
        safetensors.safe_open = real_safe_open
    ref = torch.load(folder / "ref_logits.pt")
    res = {"bytes_read": report.bytes_read, "reads": reads}
    logits = _forward(model, ref["ids"])
    if logits is not None:
        real = arch.vocab_size
        per_rank = logits.shape[-1]
        start = mp.tp_rank * per_rank
        pad = logits[..., max(real - start, 0):]
        res["padded_cols_here"] = int(pad.shape[-1])
        res["padded_all_neg_inf"] = bool(torch.isneginf(pad).all()) if pad.numel() else True
        full = full_vocab_logits(logits, arch)
        res["full_shape"] = list(full.shape)
        res["max_diff"] = float((full - ref["logits"]).abs().max())
    if spec.get("export"):
        original = {}
        for f in sorted(folder.glob("*.safetensors")):
            original.update(load_file(str(f)))
        names, exact = [], True
        for name, tensor in export_hf_weights(model):
            names.append(name)
            exact &= name in original and tensor.dtype == original[name].dtype and torch.equal(
                tensor, original[name])
        res["export_names"] = names
        res["export_exact"] = bool(exact and sorted(names) == sorted(original))
    out[spec["name"]] = res


def _train_smoke(spec: dict, out: dict) -> None:
    """DDP + DistributedOptimizer + grad clipping + the no-pipelining schedule, one Adam step
    (FINDINGS.md items 3, 5-7 on CPU): the grad norm equals plain autograd's on the same loss."""
    import torch
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from verl_hpc.models import build_gpt_model, load_arch, load_hf_weights

    arch = load_arch(spec["dir"])
    ref_model = build_gpt_model(arch)
    load_hf_weights(ref_model, spec["dir"])
    ids = torch.load(Path(spec["dir"]) / "ref_logits.pt")["ids"]
    pos = torch.arange(ids.shape[1]).unsqueeze(0).expand_as(ids)

    def loss_of(logits):
        return logits[..., : arch.vocab_size].float().pow(2).mean()

    loss_of(ref_model(ids, pos, None)).backward()
    ref_norm = float(torch.sqrt(sum((p.grad.float() ** 2).sum() for p in ref_model.parameters())))

    model = build_gpt_model(arch)
    load_hf_weights(model, spec["dir"])
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(
        use_distributed_optimizer=True, grad_reduce_in_fp32=True), model)
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, clip_grad=1e-3,
                                                 use_distributed_optimizer=True), [ddp])
    before = {n: p.detach().clone() for n, p in model.named_parameters()}

    def step(data_iterator, m):
        logits = m(next(data_iterator), pos, None)
        return logits, lambda out: (loss_of(out), {})

    ddp.zero_grad_buffer()
    opt.zero_grad()
    get_forward_backward_func()(forward_step_func=step, data_iterator=iter([ids]), model=[ddp],
                                num_microbatches=1, seq_length=ids.shape[1],
                                micro_batch_size=ids.shape[0], forward_only=False)
    ok, grad_norm, _ = opt.step()
    moved = max(float((p.detach() - before[n]).abs().max()) for n, p in model.named_parameters())
    out["train_smoke"] = {"ok": bool(ok), "grad_norm": float(grad_norm), "ref_norm": ref_norm,
                          "max_param_change": moved}


def main(scenario: str, workdir: str) -> None:
    from verl_hpc.parallel import init_model_parallel
    from verl_hpc.runtime import bootstrap

    args = json.loads((Path(workdir) / "args.json").read_text())
    ctx = bootstrap(backend="gloo", num_threads=1, timeout_s=120)
    mp = init_model_parallel(args.get("tp", 1), args.get("pp", 1), seed=1)
    out = {"rank": ctx.rank, "tp_rank": mp.tp_rank, "pp_rank": mp.pp_rank,
           "patches": [p.target for p in mp.cpu_patches], "models": {}}
    if scenario == "models":
        for spec in args["models"]:
            _check_model(spec, mp, out["models"])
        if args.get("train_smoke"):
            _train_smoke(args["train_smoke"], out)
    else:
        raise SystemExit(f"unknown scenario {scenario!r}")
    (Path(workdir) / f"rank{ctx.rank}.json").write_text(json.dumps(out))
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
