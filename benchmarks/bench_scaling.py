"""Scaling on the dev cluster: 1, 2 and 4 ranks on 1 and 2 nodes, a tiny GRPO job each.

    python benchmarks/bench_scaling.py                 # all layouts (needs start.sh --nodes 2)
    python benchmarks/bench_scaling.py --only 2x2 --steps 3 --out benchmarks/results/scaling

Each layout is a real job submitted with `python -m verl_hpc.submit` and `tracking.comm_bytes=true`:
every torch.distributed call is wrapped (runtime/collectives.py) and rank 0 logs, per stage of
each step, the payload bytes of every (collective, group). The script prints and writes
  * step time by stage (mean over the steps after the first, which warms up),
  * per collective: bytes measured on rank 0 in the last step / bytes of the analytical formula
    (benchmarks/scaling_formulas.py; goal 1.00 +- 0.02),
  * a PNG plot (stage times, and measured vs formula bytes).
Token counts come from the step's own metrics (rollout/prompt_tokens + rollout/response_tokens:
the engines run no padding), with the actor's skip of zero-advantage rows and its shared-prompt
packing switched off, so that every row runs as one sequence.

Layout "2x1e" is a mixture-of-experts job (a tiny Qwen3-MoE, 4 experts, 2 per token) at expert
parallel 2 over two nodes: its token dispatcher's all_to_all crosses the nodes. What rank 0 hands
to it depends on the routing (its tokens' copies out, the copies routed to its experts back), so
its formula takes the step's measured routing share of EP rank 0 (actor/moe/ep_rank_share/0) and
one optimizer step per RL step (old_logprob and update_actor then route with the same weights).

Layout "1x2sp" is the FSDP engine with Ulysses sequence parallelism over both ranks (fsdp.sp=2,
data-parallel 1): a tiny Llama with one KV head (repeated to 2 before the regrouping) whose random
answers run up to 1,024 tokens (a few hundred on average: it samples its EOS now and then), one
row per micro-batch. Its formula is the all-to-alls' payload
(scaling_formulas.ulysses_alltoall_bytes: 4 per layer, forward and backward), from the rows x
padded lengths the engine ran (actor/sp_padded_tokens, per optimizer step); the old-log-prob
forward runs the same one-row micro-batches. Its other collectives (FSDP's gathers and
reductions, the log-prob all-reduce) are listed without a formula.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from scaling_formulas import (Layout, Model, optimizer_bytes, pp_p2p_bytes, rollout_shard_elements,  # noqa: E402
                              sliced_sent_bytes, tp_activation_bytes, ulysses_alltoall_bytes)

# name: (nodes, tasks per node, tp, pp)
LAYOUTS = {"1x1": (1, 1, 1, 1), "1x2": (1, 2, 2, 1), "2x1": (2, 1, 1, 1), "1x4": (1, 4, 2, 2), "2x2": (2, 2, 2, 1),
           "2x2v": (2, 2, 2, 1), "2x1e": (2, 1, 1, 1), "1x2sp": (1, 2, 1, 1)}
# expert-parallel layouts: ep, and their model (a tiny mixture of experts)
EP = {"2x1e": 2}
MOE_FAMILY = "qwen3_moe"
# sequence-parallel layouts (FSDP engine, Ulysses): sp, and their job (long answers, one row per
# micro-batch, 2 optimizer steps of 2 rows)
SP = {"1x2sp": 2}
SP_JOB = ["parallel.engine=fsdp", "data.max_response_length=1024", "data.train_batch_size=2", "rollout.n=2",
          "actor.ppo_mini_batch_size=1", "actor.micro_batch_size=1"]
# inference TP of a layout's rollout (the HF rollout keeps whole tensors: 1); "v" layouts roll out
# with vLLM at rollout.tp = 2, so each rank's sliced sync receives half the model
VLLM = {"2x2v": 2}
TINY = ["rollout.engine=hf", "data.train_batch_size=4", "rollout.n=4", "actor.ppo_mini_batch_size=2",
        "actor.micro_batch_size=4", "trainer.val_every=0", "tracking.backends=[jsonl]", "tracking.plots=false",
        "tracking.comm_bytes=true", "slurm.cpus_per_task=1", "slurm.time_min=20",
        "actor.skip_zero_advantage_rows=false", "actor.share_prompts=off"]
OPT_STEPS = 2  # data.train_batch_size / actor.ppo_mini_batch_size
P2P = ("send", "recv", "batch_isend_irecv")


def assets(root: Path) -> Path:
    for folder, family in (("model", "llama"), ("moe_model", MOE_FAMILY)):
        if not (root / folder / "config.json").exists():
            subprocess.run([sys.executable, "-m", "verl_hpc.models.tiny", str(root / folder), "--layers", "2",
                            "--family", family], cwd=REPO, check=True, capture_output=True)
    if not (root / "sp_model" / "config.json").exists():  # one KV head: repeated under sp = 2
        subprocess.run([sys.executable, "-c", "import sys; from verl_hpc.models.tiny import make_tiny_model; "
                        "make_tiny_model(sys.argv[1], 'llama', layers=2, kv_heads=1, max_positions=2048)",
                        str(root / "sp_model")], cwd=REPO, check=True, capture_output=True)
    if not (root / "data" / "train.parquet").exists():
        subprocess.run([sys.executable, "-m", "verl_hpc.data.prepare", "synthetic", str(root / "data"),
                        "--n-train", "500", "--n-val", "20"], cwd=REPO, check=True, capture_output=True)
    return root


def run_layout(name: str, root: Path, out: Path, steps: int) -> list[dict]:
    nodes, tpn, tp, pp = LAYOUTS[name]
    model = model_folder(name)
    cmd = [sys.executable, "-m", "verl_hpc.submit", "configs/demo_rl.yaml", f"model.path={root}/{model}",
           f"data.train_files=[{root}/data/train.parquet]", f"data.val_files=[{root}/data/val.parquet]",
           *TINY, f"trainer.total_steps={steps}", f"parallel.tp={tp}", f"parallel.pp={pp}",
           f"slurm.nodes={nodes}", f"slurm.tasks_per_node={tpn}", f"trainer.output_dir={out}",
           f"slurm.log_dir={out}/logs/%j"]
    if name in VLLM:
        cmd += ["rollout.engine=vllm", f"rollout.tp={VLLM[name]}"]
    if name in SP:
        cmd += [*SP_JOB, f"fsdp.sp={SP[name]}"]
    if name in EP:  # one optimizer step per RL step (module docstring)
        cmd += [f"parallel.ep={EP[name]}", "actor.ppo_mini_batch_size=4"]
    t0 = time.time()
    print(f"[bench] {name}: {nodes} node(s) x {tpn} rank(s), tp={tp} pp={pp} ...", flush=True)
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"[bench] {name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    print(f"[bench] {name}: done in {time.time() - t0:.0f}s", flush=True)
    return _rows(out)


def model_folder(name: str) -> str:
    return "moe_model" if name in EP else "sp_model" if name in SP else "model"


def _rows(run: Path) -> list[dict]:
    return [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines() if ln.strip()]


def _finished(run: Path, steps: int) -> bool:
    return (run / "metrics.jsonl").exists() and len(_rows(run)) == steps


SIZE1 = "groups of one rank (handed over, nothing moves; not compared)"


def measured(row: dict, name: str) -> dict[str, float]:
    """Bytes of the last step grouped into the formula's classes (rank 0). Megatron and the
    engine call their collectives on groups of one rank too (DP at dp=1, TP at tp=1): counted,
    but kept apart, since no byte leaves the rank."""
    nodes, tpn, tp, pp = LAYOUTS[name]
    dp = nodes * tpn // (tp * pp)
    out: dict[str, float] = {}
    for key, v in row.items():
        if not key.startswith("comm_bytes/"):
            continue
        _, stage, opgroup = key.split("/", 2)
        if stage == "sync" and op_of(opgroup) == "all_gather_object":
            cls = "control (scalars, objects; no formula)"  # the plan's one exchange, first sync only
            out[cls] = out.get(cls, 0.0) + v
            continue
        op, group = opgroup.split("@", 1)
        if name in SP:
            out_cls = (f"Ulysses all_to_all ({stage})" if (op, group) == ("all_to_all_single", "sp")
                       else f"FSDP engine {op}@{group} ({stage}; no formula)")
            out[out_cls] = out.get(out_cls, 0.0) + v
            continue
        cls = classify(stage, op, group)
        if (cls.startswith("TP") and tp == 1) or (cls.startswith("DP") and dp == 1) or cls.startswith("EDP"):
            cls = SIZE1  # EDP: the expert layouts here hold each expert once (edp = 1)
        out[cls] = out.get(cls, 0.0) + v
    if "sync/bytes" in row and name not in SP:  # what rank 0's rollout engine received (its own slices included)
        out["resharding received (sync/bytes)"] = row["sync/bytes"]
    return out


def op_of(opgroup: str) -> str:
    return opgroup.split("@", 1)[0]


def classify(stage: str, op: str, group: str) -> str:
    if op in P2P:
        return f"PP p2p ({stage})"
    table = {("update_actor", "reduce_scatter_tensor", "dp"): "DP reduce-scatter (grads)",
             ("update_actor", "all_gather_into_tensor", "dp"): "DP all-gather (params)",
             ("sync", "all_to_all_single", "world"): "resharding sliced all_to_all (sent)"}
    if (stage, op, group) in table:
        return table[(stage, op, group)]
    if op == "all_to_all_single" and group == "ep":
        return f"MoE dispatcher all_to_all ({stage})"
    if group == "edp":
        return "EDP (expert grads; groups of one rank here)"
    if op == "all_reduce" and group == "dp":
        return "DP all-reduce (grads; groups of one rank here)"
    if op == "all_reduce" and group == "tp" and stage in ("old_logprob", "update_actor"):
        return f"TP all-reduce ({stage})"
    return "control (scalars, objects; no formula)"


def sp_formulas(name: str, m: Model, row: dict) -> dict[str, float]:
    """The Ulysses all-to-alls of one RL step on rank 0: the update's micro-batches (OPT_STEPS
    optimizer steps; the metric is their mean) forward and backward, and the old log-probs'
    forward over the same one-row micro-batches. fp32 activations (CPU, fsdp.mixed_precision auto)."""
    nodes, tpn, _, _ = LAYOUTS[name]
    groups = nodes * tpn // SP[name]  # the metric sums the data-parallel groups; a rank moves its group's
    tokens = row["actor/sp_padded_tokens"] * OPT_STEPS / groups  # rows x padded lengths, all micro-batches
    mbs = [(1, tokens)]  # the formula sums rows x lengths; one entry carries the sum
    return {"Ulysses all_to_all (old_logprob)": ulysses_alltoall_bytes(m, SP[name], mbs, 4, backward=False),
            "Ulysses all_to_all (update_actor)": ulysses_alltoall_bytes(m, SP[name], mbs, 4, backward=True)}


def formulas(name: str, m: Model, row: dict) -> dict[str, float]:
    if name in SP:
        return sp_formulas(name, m, row)
    nodes, tpn, tp, pp = LAYOUTS[name]
    lay = Layout(tp=tp, pp=pp, dp=nodes * tpn // (tp * pp), ep=EP.get(name, 1))
    # per DP replica (= per rank of a TP/PP group); the engines run the real tokens, no padding
    tokens = (row["rollout/prompt_tokens"] + row["rollout/response_tokens"]) / lay.dp
    resp = row["rollout/response_tokens"] / lay.dp
    f: dict[str, float] = {}
    names = {"reduce_scatter_tensor": "DP reduce-scatter (grads)", "all_gather_into_tensor": "DP all-gather (params)"}
    opt_steps = 1 if name in EP else OPT_STEPS
    for (op, _), b in optimizer_bytes(m, lay, grad_bytes=4, param_bytes=4).items():
        # an MoE model's optimizer is Megatron's chain of two distributed optimizers (dense, expert);
        # without overlap_param_gather (CPU) 0.16.1 has each of them all-gather every buffer of the
        # model after its step (DistributedOptimizer.step_with_ready_grads -> start_param_sync, which
        # walks the dense and the expert buckets): the dense parameters are gathered twice
        f[names[op]] = b * opt_steps * (2 if name in EP and op == "all_gather_into_tensor" else 1)
    if name in EP:
        # rank 0 hands the dispatch its tokens' top_k copies and the combine the copies routed to
        # its experts (share_0 of all copies), per MoE layer, forward and backward. One optimizer
        # step per RL step: the actor's old log-probs are the update's own (no old_logprob pass).
        copies = m.top_k * m.layers
        rank0 = tokens * copies + row["actor/moe/ep_rank_share/0"] * tokens * lay.dp * copies
        f["MoE dispatcher all_to_all (update_actor)"] = 2 * rank0 * m.hidden * 4
    # the sliced weight sync (resharding.mode auto); the HF rollout keeps whole tensors (inference
    # TP 1); vLLM at the training TP takes all its slices from its own shard (nothing sent)
    infer_tp = VLLM.get(name, 1)
    if nodes * tpn > 1:
        f["resharding sliced all_to_all (sent)"] = sliced_sent_bytes(m, lay, 4) if infer_tp == 1 else 0
    f["resharding received (sync/bytes)"] = rollout_shard_elements(m, infer_tp) * 4
    # rank 0 sits on the first pipeline stage (and the last one only when pp == 1)
    f["TP all-reduce (old_logprob)"] = tp_activation_bytes(m, lay, tokens, 4, False, resp_tokens=resp)
    f["TP all-reduce (update_actor)"] = tp_activation_bytes(m, lay, tokens, 4, True, resp_tokens=resp)
    f["PP p2p (old_logprob)"] = pp_p2p_bytes(m, lay, tokens, 4, False)
    f["PP p2p (update_actor)"] = pp_p2p_bytes(m, lay, tokens, 4, True)
    f = {k: v for k, v in f.items() if v or k.startswith("resharding")}  # a sync that sends nothing: 0
    return f


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(13, 4.5))
    names = list(results)
    stages = sorted({s for r in results.values() for s in r["stage_s"] if s != "step"})
    bottom = [0.0] * len(names)
    for s in stages:
        vals = [results[n]["stage_s"].get(s, 0.0) for n in names]
        a1.bar(names, vals, bottom=bottom, label=s)
        bottom = [b + v for b, v in zip(bottom, vals)]
    a1.set_ylabel("seconds per step (mean)")
    a1.set_xlabel("nodes x ranks per node")
    a1.set_title("step time by stage")
    a1.legend(fontsize=7)
    xs, ys, labels = [], [], []
    for n in names:
        for cls, (meas, form) in results[n]["bytes"].items():
            if form:
                xs.append(form)
                ys.append(meas)
                labels.append(f"{n} {cls}")
    a2.loglog(xs, ys, "o")
    lo, hi = min(xs + ys) / 2, max(xs + ys) * 2
    a2.loglog([lo, hi], [lo, hi], "k--", lw=0.8, label="measured = formula")
    a2.set_xlabel("formula bytes per step (rank 0)")
    a2.set_ylabel("measured bytes per step (rank 0)")
    a2.set_title("collective payload: measured vs formula")
    a2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", nargs="*", default=list(LAYOUTS), choices=list(LAYOUTS))
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--out", default="benchmarks/results/scaling")
    p.add_argument("--work", default="outputs/bench_scaling", help="job folders (assets, runs)")
    p.add_argument("--reuse", action="store_true",
                   help="take a layout's newest finished run under --work instead of running it again")
    a = p.parse_args(argv)
    out, work = Path(a.out), Path(a.work).absolute()
    out.mkdir(parents=True, exist_ok=True)
    root = assets(work / "assets")
    results = {}
    for name in a.only:
        done = [d for d in sorted(work.glob(f"run_{name}_*")) if _finished(d, a.steps)]
        if a.reuse and done:
            print(f"[bench] {name}: reusing {done[-1]}")
            rows = _rows(done[-1])
        else:
            rows = run_layout(name, root, work / f"run_{name}_{time.strftime('%H%M%S')}", a.steps)
        later = rows[1:] or rows
        stage_s = {}
        for k in sorted({k for r in later for k in r if k.startswith("timing_s/")}):
            stage_s[k.split("/", 1)[1]] = sum(r.get(k, 0.0) for r in later) / len(later)
        m = Model.from_hf(root / model_folder(name))
        meas, form = measured(rows[-1], name), formulas(name, m, rows[-1])
        results[name] = dict(stage_s=stage_s, bytes={c: (meas.get(c, 0.0), form.get(c)) for c in sorted(set(meas) | set(form))})
    lines = ["| layout | stage times, s (mean of steps 2..) | step s |", "|---|---|---:|"]
    for n, r in results.items():
        st = ", ".join(f"{k} {v:.2f}" for k, v in r["stage_s"].items() if k != "step")
        lines.append(f"| {n} | {st} | {r['stage_s'].get('step', 0):.2f} |")
    lines += ["", "| layout | collective | measured bytes | formula bytes | ratio |", "|---|---|---:|---:|---:|"]
    for n, r in results.items():
        for cls, (meas, form) in r["bytes"].items():
            ratio = f"{meas / form:.3f}" if form else ("exact" if form == 0 and meas == 0 else "-")
            lines.append(f"| {n} | {cls} | {meas:,.0f} | {form:,.0f} | {ratio} |" if form is not None else
                         f"| {n} | {cls} | {meas:,.0f} | - | - |")
    table = "\n".join(lines)
    print(table)
    (out / "scaling.md").write_text(table + "\n")
    (out / "scaling.json").write_text(json.dumps(results, indent=1))
    plot(results, out / "scaling.png")
    ratios = [meas / form if form else (1.0 if meas == 0 else float("inf"))
              for r in results.values() for meas, form in r["bytes"].values() if form is not None]
    bad = [x for x in ratios if abs(x - 1) > 0.02]
    print(f"\n[bench] {len(ratios)} collectives with a formula; {len(bad)} outside 1.00 +- 0.02; "
          f"wrote {out}/scaling.md, scaling.json, scaling.png")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
