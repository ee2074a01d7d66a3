"""The verdicts and the printed table of benchmarks/bench_gpu_step.py, from its result dict (the
JSON it writes).

Goals (issue 75), on an H100 or H200, 886M Llama, 8 x 2,048 tokens, against plain transformers and
against transformers + Liger (the peer TRL's `use_liger_kernel` gives) each:
- train tokens/s: the Megatron engine >= 1.2x, the FSDP engine >= 1.15x;
- train MFU >= 38% for both;
- the log-prob pass >= 1.1x for both.
"""
from __future__ import annotations

from typing import Dict, List

GOAL_TRAIN = {"engine": 1.2, "fsdp": 1.15}  # train tokens/s over each baseline's
GOAL_MFU = 0.38
GOAL_FORWARD = 1.1  # the log-prob pass over each baseline's
BOARDS = ("h100-80gb", "h100-pcie", "h200")  # where the goals are set
TITLES = {"engine": "megatron", "engine_whole": "megatron-whole", "engine_chunked": "megatron-chunk256",
          "fsdp": "fsdp", "fsdp_whole": "fsdp-whole", "fsdp_chunked": "fsdp-chunk256", "fsdp_compile": "fsdp-compile",
          "fsdp_foreach": "fsdp-foreach", "fsdp_noliger": "fsdp-noliger", "fsdp_keep": "fsdp-keep",
          "fsdp_loopclip": "fsdp-loopclip", "transformers": "transformers", "transformers_liger": "tf+liger"}
ENGINE_TITLES = {"engine": "megatron", "fsdp": "fsdp"}
BASELINE_TITLES = {"transformers": "transformers", "transformers_liger": "transformers + Liger"}


def goal_rows() -> List[tuple]:
    """(key, side, what, baseline, goal) of every goal, in the order they are printed."""
    rows = []
    for side in ("engine", "fsdp"):
        for base in ("transformers", "transformers_liger"):
            rows.append((f"{side}_train_vs_{base}", side, "train", base, GOAL_TRAIN[side]))
        rows.append((f"{side}_mfu", side, "mfu", None, GOAL_MFU))
        for base in ("transformers", "transformers_liger"):
            rows.append((f"{side}_forward_vs_{base}", side, "forward", base, GOAL_FORWARD))
    return rows


def goals(result: dict, rehearsal: bool, gpu_key) -> Dict[str, dict]:
    """{key: {goal, value, met, note}}; met None: not evaluated here, the note says why."""
    out = {}
    for key, side, what, base, goal in goal_rows():
        value, why = None, ""
        if side not in result["sides"]:
            why = (f"{ENGINE_TITLES[side]} did not run: "
                   + (result.get("failed", {}).get(side) or result["not_run"].get(side) or "not asked for"))
        elif base is not None and base not in result["sides"]:
            why = (f"{BASELINE_TITLES[base]} did not run: "
                   + (result.get("failed", {}).get(base) or result["not_run"].get(base) or "not asked for"))
        elif what == "mfu":
            value = result[side]["train"]["mfu"]
            why = "" if value is not None else "no dense bf16 peak known for this board"
        else:
            value = result[side][what]["tok_s"] / result[base][what]["tok_s"]
        if rehearsal:
            why = "CPU rehearsal: no performance claim"
        elif not why and gpu_key not in BOARDS:
            why = "the goals are set for an H100 or H200; this board is neither"
        met = None if (rehearsal or value is None) else value >= goal
        out[key] = {"goal": goal, "value": value, "met": met, "note": why}
    return out


def goal_lines(result: dict) -> List[str]:
    """One line per goal: what, the figure, PASS / FAIL / NOT EVALUATED (why)."""
    lines = []
    for key, side, what, base, goal in goal_rows():
        g = result["goals"][key]
        label = (f"{ENGINE_TITLES[side]} train MFU >= {goal:.0%}" if what == "mfu" else
                 f"{ENGINE_TITLES[side]} {'train' if what == 'train' else 'log-prob pass'} >= {goal}x "
                 f"{BASELINE_TITLES[base]}")
        value = "-" if g["value"] is None else (f"{g['value']:.1%}" if what == "mfu" else f"{g['value']:.2f}x")
        met = {True: "PASS", False: "FAIL", None: "NOT EVALUATED"}[g["met"]]
        lines.append(f"goal: {label}: {value} {met}" + (f" ({g['note']})" if g["note"] else ""))
    return lines


def table(r: dict) -> str:
    """The printed summary of a result: one column per side that ran, then each engine's ratio
    to transformers (and to transformers + Liger where it ran), the kernels, the goals."""
    gib = (lambda b: "-" if b is None else f"{b / 2**30:.2f}")
    pct = (lambda x: "-" if x is None else f"{100 * x:.1f}%")
    m, sides = r["model"], r["sides"]
    engines = [s for s in sides if s in r["ratios"]]
    liger = [s for s in sides if s in r.get("ratios_liger", {})]
    w = max(len(TITLES[x]) for x in sides) + 3
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
    lines += [f"FAILED: {TITLES[s]}: {why}" for s, why in r.get("failed", {}).items()]
    lines.append(f"{'':24}" + "".join(f"{TITLES[s]:>{w}}" for s in sides))
    for part, title in (("train", "train step"), ("forward", "log-prob pass")):
        row = (lambda label, fmt: f"{label:24}" + "".join(f"{fmt(r[s][part]):>{w}}" for s in sides))
        lines += [row(title + " tokens/s", lambda x: f"{x['tok_s']:.0f}"),
                  f"{'  vs transformers':24}" + "".join(
                      f"{r['ratios'][s][part]:>{w - 1}.2f}x" if s in engines else f"{'':>{w}}" for s in sides),
                  *([f"{'  vs tf+liger':24}" + "".join(
                      f"{r['ratios_liger'][s][part]:>{w - 1}.2f}x" if s in liger else f"{'':>{w}}" for s in sides)]
                    if liger else []),
                  row("  model TFLOP/s", lambda x: f"{x['tflops']:.2f}"),
                  row("  MFU", lambda x: pct(x["mfu"])),
                  row("  peak memory GiB", lambda x: gib(x["peak_bytes"]))
                  + ("  (training state resident)" if part == "forward" else ""),
                  row("  median s", lambda x: f"{x['median_s']:.4f}")]
    lines.append(f"{'first loss':24}" + "".join(f"{r[s]['first_loss']:>{w}.5f}" for s in sides)
                 + "  (|diff| to transformers: " + ", ".join(
                     f"{TITLES[s]} {r['first_loss_abs_diff'][s]:.2g}" for s in sides if s in r["first_loss_abs_diff"])
                 + "; same weights and batch)")
    for s in sides:
        k = dict(r[s]["kernels"])
        ops = k.pop("profiled_ops")
        lines.append(f"kernels, {TITLES[s]}: " + "; ".join(f"{a}: {b}" for a, b in k.items()))
        lines.append(f"  profiled ops, {TITLES[s]}: " + "; ".join(
            f"{a}: {', '.join(b) or 'none'}" for a, b in ops.items()))
    lines += [f"  diagnostics, {TITLES[s]}: {diagnostics_line(r[s].get('diagnostics') or {})}" for s in sides]
    a = r.get("attention_costs") or {}
    if "pair_weight_causal" in a:
        lines.append(f"attention per (query, key) pair over one token's linear work: causal "
                     f"{a['pair_weight_causal']:.4f}, dense mask {a['pair_weight_dense_mask']:.4f} (cost model: "
                     f"{a['pair_weight_cost_model']:.4f} for both)")
    elif a:
        lines.append(f"attention costs: not measured ({a.get('error')})")
    lines += goal_lines(r)
    lines.append(f"elapsed {r['elapsed_s']:.0f} s (limit {r['time_limit_s']:.0f} s)")
    return "\n".join(lines)


def diagnostics_line(d: dict) -> str:
    """One line of a side's diagnostics (bench_gpu_step.py run_side; gpu_step_diag.py)."""
    if not d:
        return "not taken"
    k, h = d.get("kernel_profile") or {}, d.get("host_syncs") or {}
    opt = k.get("optimizer_phase") or {}
    parts = [f"{k.get('unit', '?')}: busy {k.get('busy_ms', 0):.1f} of {k.get('span_ms', 0):.1f} ms"]
    if opt:
        parts.append(f"optimizer phase {opt['ms']:.1f} ms, idle {opt['idle_ms']:.1f}")
    rec = h.get("recorded") or {}
    parts.append("host syncs " + (", ".join(f"{n} {c}" for n, c in rec.items() if c) or "none"))
    if h.get("cuda_sync_debug_total") is not None:
        parts.append(f"CUDA sync debug {h['cuda_sync_debug_total']}")
    reads = d.get("output_layer_steps_1_to_3") or []
    gb = (lambda b: "-" if b is None else f"{b / 1e9:.3g}")
    parts.append("output layer steps 1-3: " + "; ".join(
        f"{x['path']} (free {gb(x['free_bytes'])} GB, Adam to come {gb(x['pending_bytes'])} GB)" for x in reads))
    return "; ".join(parts)
