"""The verdicts and the printed table of benchmarks/bench_gpu_step.py, from its result dict (the
JSON it writes)."""
from __future__ import annotations

GOAL_RATIO = 1.3  # engine train tokens/s over transformers', on an H100
GOAL_MFU = 0.40  # engine train MFU, on an H100
H100_TYPES = ("h100-80gb", "h100-pcie")


def goals(result: dict, rehearsal: bool, gpu_key) -> dict:
    """Whether the goals are met (None: not evaluated here, with why)."""
    ratio = result["ratios"]["train"]
    mfu = result["engine"]["train"]["mfu"]
    if rehearsal:
        why = "CPU rehearsal: no performance claim"
        return {"ratio": {"goal": GOAL_RATIO, "value": ratio, "met": None, "note": why},
                "mfu": {"goal": GOAL_MFU, "value": mfu, "met": None, "note": why}}
    on_h100 = gpu_key in H100_TYPES
    note = "" if on_h100 else "the goals are set for an H100; this board is not one"
    return {"ratio": {"goal": GOAL_RATIO, "value": ratio, "met": ratio >= GOAL_RATIO, "note": note},
            "mfu": {"goal": GOAL_MFU, "value": mfu, "met": None if mfu is None else mfu >= GOAL_MFU,
                    "note": note if mfu is not None else "no dense bf16 peak known for this board"}}


def table(r: dict) -> str:
    """The printed summary of a result."""
    gib = (lambda b: "-" if b is None else f"{b / 2**30:.2f}")
    pct = (lambda x: "-" if x is None else f"{100 * x:.1f}%")
    e, h, m = r["engine"], r["transformers"], r["model"]
    lines = [
        f"bench_gpu_step ({r['mode']}): {r['device']}; dense bf16 peak "
        + (f"{r['peak_bf16_tflops']:.0f} TFLOP/s ({r['gpu_type']})" if r["peak_bf16_tflops"]
           else "unknown for this device: no MFU"),
        f"model: Llama {m['params'] / 1e6:.1f}M parameters ({m['params_matmul'] / 1e6:.1f}M in matmuls), hidden "
        f"{m['hidden']}, {m['layers']} layers, {m['heads']} heads / {m['kv_heads']} KV, ffn {m['ffn']}, vocab {m['vocab']}",
        f"batch: {m['seqs']} x {m['seq']} tokens ({m['prompt']} prompt + {m['seq'] - m['prompt']} response), "
        f"{r['dtype']}{', bf16 autocast (transformers)' if r['autocast'] else ''}; {r['rounds']} round(s), "
        f"{r['warmup_iters']} warm-up, medians of {e['train']['iters']} (engine) / {h['train']['iters']} (transformers)",
        f"{'':24}{'engine':>14}{'transformers':>14}{'engine/tf':>11}",
    ]
    for part, title in (("train", "train step"), ("forward", "log-prob pass")):
        a, b = e[part], h[part]
        ratio = r["ratios"][part]
        lines += [f"{title + ' tokens/s':24}{a['tok_s']:>14.0f}{b['tok_s']:>14.0f}{ratio:>10.2f}x",
                  f"{'  model TFLOP/s':24}{a['tflops']:>14.2f}{b['tflops']:>14.2f}",
                  f"{'  MFU':24}{pct(a['mfu']):>14}{pct(b['mfu']):>14}",
                  f"{'  peak memory GiB':24}{gib(a['peak_bytes']):>14}{gib(b['peak_bytes']):>14}"
                  + ("  (training state resident)" if part == "forward" else ""),
                  f"{'  median s':24}{a['median_s']:>14.4f}{b['median_s']:>14.4f}"]
    lines.append(f"{'first loss':24}{e['first_loss']:>14.5f}{h['first_loss']:>14.5f}"
                 f"  (|diff| {r['first_loss_abs_diff']:.2g}: same weights and batch)")
    for name, side in (("engine", e), ("transformers", h)):
        k = dict(side["kernels"])
        ops = k.pop("profiled_ops")
        lines.append(f"kernels, {name}: " + "; ".join(f"{a}: {b}" for a, b in k.items()))
        lines.append(f"  profiled ops, {name}: " + "; ".join(
            f"{a}: {', '.join(b) or 'none'}" for a, b in ops.items()))
    for key, label, fmt in (("ratio", f"engine train >= {GOAL_RATIO}x transformers", "{:.2f}x"),
                            ("mfu", f"engine train MFU >= {GOAL_MFU:.0%}", "{:.1%}")):
        g = r["goals"][key]
        value = "-" if g["value"] is None else fmt.format(g["value"])
        met = {True: "MET", False: "NOT MET", None: "not evaluated"}[g["met"]]
        lines.append(f"goal: {label}: {value} {met}" + (f" ({g['note']})" if g["note"] else ""))
    lines.append(f"elapsed {r['elapsed_s']:.0f} s (limit {r['time_limit_s']:.0f} s)")
    return "\n".join(lines)
