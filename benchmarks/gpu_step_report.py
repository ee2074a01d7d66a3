"""The verdicts and the printed table of benchmarks/bench_gpu_step.py, from its result dict (the
JSON it writes)."""
from __future__ import annotations

GOAL_RATIO = 1.3  # Megatron engine train tokens/s over transformers', on an H100
GOAL_MFU = 0.40  # Megatron engine train MFU, on an H100
H100_TYPES = ("h100-80gb", "h100-pcie")
GOAL_FSDP_RATIO = 1.0  # FSDP engine train tokens/s over transformers', on an H100
GOAL_FSDP_MFU = 0.35
TITLES = {"engine": "megatron", "fsdp": "fsdp", "fsdp_whole": "fsdp-whole", "fsdp_foreach": "fsdp-foreach",
          "fsdp_noliger": "fsdp-noliger", "transformers": "transformers"}


def goals(result: dict, rehearsal: bool, gpu_key) -> dict:
    """Whether the engines' goals are met (None: not evaluated here, with why): "ratio" / "mfu"
    the Megatron engine's, "fsdp_ratio" / "fsdp_mfu" the FSDP engine's."""
    out = {}
    for prefix, side, title, goal_ratio, goal_mfu in (("", "engine", "the Megatron engine", GOAL_RATIO, GOAL_MFU),
                                                      ("fsdp_", "fsdp", "the FSDP engine", GOAL_FSDP_RATIO,
                                                       GOAL_FSDP_MFU)):
        ran = side in result["ratios"]
        ratio = result["ratios"][side]["train"] if ran else None
        mfu = result[side]["train"]["mfu"] if ran else None
        if rehearsal or not ran:
            why = ("CPU rehearsal: no performance claim" if rehearsal else
                   f"{title} did not run: {result['not_run'].get(side, 'not asked for')}")
            out[prefix + "ratio"] = {"goal": goal_ratio, "value": ratio, "met": None, "note": why}
            out[prefix + "mfu"] = {"goal": goal_mfu, "value": mfu, "met": None, "note": why}
            continue
        note = "" if gpu_key in H100_TYPES else "the goals are set for an H100; this board is not one"
        out[prefix + "ratio"] = {"goal": goal_ratio, "value": ratio, "met": ratio >= goal_ratio, "note": note}
        out[prefix + "mfu"] = {"goal": goal_mfu, "value": mfu, "met": None if mfu is None else mfu >= goal_mfu,
                               "note": note if mfu is not None else "no dense bf16 peak known for this board"}
    return out


def table(r: dict) -> str:
    """The printed summary of a result: one column per side that ran, then each engine's ratio
    to transformers."""
    gib = (lambda b: "-" if b is None else f"{b / 2**30:.2f}")
    pct = (lambda x: "-" if x is None else f"{100 * x:.1f}%")
    m, sides = r["model"], r["sides"]
    engines = [s for s in sides if s in r["ratios"]]
    w = 14
    lines = [
        f"bench_gpu_step ({r['mode']}): {r['device']}; dense bf16 peak "
        + (f"{r['peak_bf16_tflops']:.0f} TFLOP/s ({r['gpu_type']})" if r["peak_bf16_tflops"]
           else "unknown for this device: no MFU"),
        f"model: Llama {m['params'] / 1e6:.1f}M parameters ({m['params_matmul'] / 1e6:.1f}M in matmuls), hidden "
        f"{m['hidden']}, {m['layers']} layers, {m['heads']} heads / {m['kv_heads']} KV, ffn {m['ffn']}, vocab {m['vocab']}",
        f"batch: {m['seqs']} x {m['seq']} tokens ({m['prompt']} prompt + {m['seq'] - m['prompt']} response), "
        f"{r['dtype']}{', bf16 autocast (transformers)' if r['autocast'] else ''}; {r['rounds']} round(s), "
        f"{r['warmup_iters']} warm-up, medians of "
        + " / ".join(f"{r[s]['train']['iters']} ({TITLES[s]})" for s in sides),
    ]
    lines += [f"not run: {TITLES[s]}: {why}" for s, why in r["not_run"].items()]
    lines.append(f"{'':24}" + "".join(f"{TITLES[s]:>{w}}" for s in sides)
                 + "".join(f"{TITLES[s] + '/tf':>{w}}" for s in engines))
    for part, title in (("train", "train step"), ("forward", "log-prob pass")):
        row = (lambda label, fmt: f"{label:24}" + "".join(f"{fmt(r[s][part]):>{w}}" for s in sides))
        lines += [row(title + " tokens/s", lambda x: f"{x['tok_s']:.0f}")
                  + "".join(f"{r['ratios'][s][part]:>{w - 1}.2f}x" for s in engines),
                  row("  model TFLOP/s", lambda x: f"{x['tflops']:.2f}"),
                  row("  MFU", lambda x: pct(x["mfu"])),
                  row("  peak memory GiB", lambda x: gib(x["peak_bytes"]))
                  + ("  (training state resident)" if part == "forward" else ""),
                  row("  median s", lambda x: f"{x['median_s']:.4f}")]
    lines.append(f"{'first loss':24}" + "".join(f"{r[s]['first_loss']:>{w}.5f}" for s in sides)
                 + "  (|diff| to transformers: " + ", ".join(
                     f"{TITLES[s]} {r['first_loss_abs_diff'][s]:.2g}" for s in engines) + "; same weights and batch)")
    for s in sides:
        k = dict(r[s]["kernels"])
        ops = k.pop("profiled_ops")
        lines.append(f"kernels, {TITLES[s]}: " + "; ".join(f"{a}: {b}" for a, b in k.items()))
        lines.append(f"  profiled ops, {TITLES[s]}: " + "; ".join(
            f"{a}: {', '.join(b) or 'none'}" for a, b in ops.items()))
    for key, label, fmt in (("ratio", f"megatron train >= {GOAL_RATIO}x transformers", "{:.2f}x"),
                            ("mfu", f"megatron train MFU >= {GOAL_MFU:.0%}", "{:.1%}"),
                            ("fsdp_ratio", f"fsdp train >= {GOAL_FSDP_RATIO}x transformers", "{:.2f}x"),
                            ("fsdp_mfu", f"fsdp train MFU >= {GOAL_FSDP_MFU:.0%}", "{:.1%}")):
        g = r["goals"][key]
        value = "-" if g["value"] is None else fmt.format(g["value"])
        met = {True: "MET", False: "NOT MET", None: "not evaluated"}[g["met"]]
        lines.append(f"goal: {label}: {value} {met}" + (f" ({g['note']})" if g["note"] else ""))
    lines.append(f"elapsed {r['elapsed_s']:.0f} s (limit {r['time_limit_s']:.0f} s)")
    return "\n".join(lines)
