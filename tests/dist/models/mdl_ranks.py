"""Spawn gloo ranks that run a model scenario under the project's runtime, and the scenarios.

`launch(n, scenario, args, workdir)` starts n copies of this file with torchrun-style variables
(RANK, WORLD_SIZE, MASTER_ADDR/PORT), so `verl_hpc.runtime.bootstrap()` brings each rank up as
in a real job; each rank writes `rank{r}.json` and the results come back as a list. A failing
rank fails the launch with every rank's log tail.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]



def launch(world_size: int, scenario: str, args: dict, workdir: Path, timeout: float = 300):
    from rank_launcher import launch_ranks  # tests/: on sys.path under pytest, not in the ranks

    return launch_ranks(__file__, world_size, args, workdir, argv=[scenario], timeout=timeout, what=scenario)


# ----------------------------------------------------------------------------- rank side


def _forward(chunks, ids):
    """Logits through Megatron's own schedule (pipelined with p2p when pp > 1, interleaved with
    virtual stages), one sequence per micro-batch; None off the last stage. Exercises the
    schedule/p2p CPU help, not only the model."""
    import torch
    from megatron.core.pipeline_parallel import get_forward_backward_func

    captured = []
    pos = torch.arange(ids.shape[1]).unsqueeze(0)

    def loss_func(output):
        captured.append(output.detach())
        return output.sum() * 0.0, {}

    def step(data_iterator, m):
        return m(next(data_iterator), pos, None), loss_func

    for chunk in chunks:  # inference: Megatron's MoE layer refuses TP without SP only in training
        chunk.eval()
    batches = [ids[i:i + 1] for i in range(ids.shape[0])]
    iters = [iter(batches) for _ in chunks] if len(chunks) > 1 else iter(batches)
    with torch.no_grad():
        get_forward_backward_func()(
            forward_step_func=step, data_iterator=iters, model=chunks,
            num_microbatches=len(batches), seq_length=ids.shape[1], micro_batch_size=1,
            forward_only=True)
    return torch.cat(captured) if captured else None


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


def _check_model(spec: dict, mp, out: dict) -> None:  # noqa: C901 (one check list per model)
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
    model = [build_gpt_model(arch, vp_stage=i) for i in range(mp.vpp)] if mp.vpp else [
        build_gpt_model(arch)]  # a list either way (the sliced checks iterate its chunks)
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
        res["stage_export_names"] = [n for n, _ in export_hf_weights(model, all_stages=False)]
    if spec.get("sliced"):
        res["sliced"] = _sliced_syncs(model, folder)
    out[spec["name"]] = res


SYNC_KEYS = ("sync/bytes", "sync/wire_bytes", "sync/dense_bytes", "sync/changed_fraction")


def _sliced_syncs(model, folder) -> dict:
    """The sliced sync (dense, then delta) from this layout into inference TP 1, 2 and 4: each
    rank's slices must equal the same slices of the checkpoint (dense), then of the exported
    weights after every 101st element of every parameter moved (delta); bytes are recorded for
    the test's formula. Moves the model's weights."""
    import torch
    import torch.distributed as dist
    from safetensors.torch import load_file

    from verl_hpc.models import export_hf_weights
    from verl_hpc.resharding import SliceSink, WeightSync

    current = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        current.update(load_file(str(f)))
    if model_tied(model):
        current.pop("lm_head.weight", None)
    out = {}
    for itp in (1, 2, 4):
        for delta in (False, True):
            sink = SliceSink(dist.get_rank() % itp, itp)
            syncer = WeightSync(bucket_mb=0.05, mode="sliced", delta=delta)
            first = syncer(model, sink)
            bad = sink.mismatches(current)
            row = dict(first={k: first[k] for k in SYNC_KEYS}, bad=bad)
            if delta:
                with torch.no_grad():
                    for p in (q for chunk in model for q in chunk.parameters()):
                        p.view(-1)[::101] += 0.01
                current = {n: t.clone() for n, t in export_hf_weights(model)}
                second = syncer(model, sink)
                row["second"] = {k: second[k] for k in SYNC_KEYS}
                row["bad"] = bad + sink.mismatches(current)
            out[f"itp{itp}" + ("_delta" if delta else "")] = row
    return out


def model_tied(model) -> bool:
    from verl_hpc.models.weights import model_arch

    return bool(model_arch(model).tie_word_embeddings)


def _train_smoke(spec: dict, out: dict) -> None:
    """DDP + DistributedOptimizer + grad clipping + the no-pipelining schedule, one Adam step
    (docs/platform-notes.md, "megatron-core 0.16.1 on CPU", items 3, 5-7). Megatron's global grad
    norm of the next-token cross-entropy must equal transformers' (computed by the test): at
    TP > 1 that needs every split weight to carry Megatron's tensor-parallel attributes, and the
    -inf padded columns must not disturb the vocab-parallel cross-entropy."""
    import torch
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from verl_hpc.models import build_gpt_model, export_hf_weights, load_arch, load_hf_weights
    from verl_hpc.models.gpt import full_vocab_logits

    arch = load_arch(spec["dir"])
    ref = torch.load(Path(spec["dir"]) / "ref_logits.pt")
    ids = ref["ids"]
    pos = torch.arange(ids.shape[1]).unsqueeze(0).expand_as(ids)
    model = build_gpt_model(arch)
    load_hf_weights(model, spec["dir"])
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(
        use_distributed_optimizer=True, grad_reduce_in_fp32=True), model)
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, clip_grad=1e-3,
                                                 use_distributed_optimizer=True), [ddp])
    before = {n: p.detach().clone() for n, p in model.named_parameters()}

    labels = ids.roll(-1, dims=1)

    def step(data_iterator, m):
        # labels=: Megatron's vocab-parallel cross-entropy over logits whose padded columns are
        # -inf; returns the per-token loss
        return m(next(data_iterator), pos, None, labels=labels), lambda o: (o.float().mean(), {})

    ddp.zero_grad_buffer()
    opt.zero_grad()
    get_forward_backward_func()(forward_step_func=step, data_iterator=iter([ids]), model=[ddp],
                                num_microbatches=1, seq_length=ids.shape[1],
                                micro_batch_size=ids.shape[0], forward_only=False)
    ok, grad_norm, _ = opt.step()
    moved = max(float((p.detach() - before[n]).abs().max()) for n, p in model.named_parameters())
    # export after the step, from the DDP-wrapped model: the test loads it into transformers
    with torch.no_grad():
        logits = full_vocab_logits(model(ids, pos, None), arch)
    exported = {n: t.clone() for n, t in export_hf_weights(ddp)}
    if torch.distributed.get_rank() == 0:
        torch.save({"state": exported, "logits": logits, "ids": ids}, spec["save_to"])
    unmarked = [n for n, p in model.named_parameters()
                if p.dim() == 2 and "layernorm" not in n and not getattr(p, "tensor_model_parallel", False)]
    out["train_smoke"] = {"ok": bool(ok), "grad_norm": float(grad_norm),
                          "ref_norm": float(ref["grad_norm"]), "max_param_change": moved,
                          "unmarked_split_weights": unmarked}


def _run_layout(layout: dict) -> dict:
    from verl_hpc.parallel import destroy_model_parallel, init_model_parallel

    t = time.time()
    mp = init_model_parallel(layout["tp"], layout["pp"], vpp=layout.get("vpp"), ep=layout.get("ep", 1), seed=1)
    out = {"tp_rank": mp.tp_rank, "pp_rank": mp.pp_rank, "dp_rank": mp.dp_rank, "dp": mp.dp,
           "ep_rank": mp.ep_rank, "ep": mp.ep,
           "patches": [p.target for p in mp.cpu_patches], "models": {},
           "seconds": {"model_parallel_init": time.time() - t}}
    for spec in layout["models"]:
        t = time.time()
        _check_model(spec, mp, out["models"])
        out["seconds"][spec["name"]] = time.time() - t
    if layout.get("train_smoke"):
        t = time.time()
        _train_smoke(layout["train_smoke"], out)
        out["seconds"]["train_smoke"] = time.time() - t
    destroy_model_parallel()
    return out


def main(scenario: str, workdir: str) -> None:
    """Scenario "layouts": for each layout in args["layouts"] in turn, initialise Megatron model
    parallelism over the same ranks (data parallel fills the rest), run its checks, tear it
    down. One process set serves every layout: importing megatron on 4 ranks sharing 2 cores
    costs far more than the checks themselves."""
    import torch.distributed as dist

    from verl_hpc.runtime import bootstrap

    t0 = time.time()
    args = json.loads((Path(workdir) / "args.json").read_text())
    ctx = bootstrap(backend="gloo", num_threads=1, timeout_s=180)
    out = {"rank": ctx.rank, "layouts": {}, "seconds": {"bootstrap": time.time() - t0}}
    if scenario != "layouts":
        raise SystemExit(f"unknown scenario {scenario!r}")
    for layout in args["layouts"]:
        out["layouts"][layout["name"]] = _run_layout(layout)
    (Path(workdir) / f"rank{ctx.rank}.json").write_text(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
