"""The output layer alone on one GPU at a Qwen vocabulary (V = 151,936, hidden 1,024, bf16): an
update's time and peak memory, the whole logits against the chunks, at 2 x 4,096 and 8 x 4,096
scored tokens.

    python benchmarks/bench_gpu_logits.py [--cpu-rehearsal] [--out DIR] [--time-limit SECONDS]

Writes DIR/bench_gpu_logits.json (default DIR: outputs/bench_gpu_logits) and prints a table. An
update: the per-token log-probs and entropy of softmax(hidden @ W^T) (verl_hpc/engines/logits.py),
a loss that reads both (sum log p + 0.01 sum H), its backward into the hidden states and W.
Paths, each timed (medians, synchronized; one warm-up) with its peak (max_memory_allocated over
the timed calls minus what was allocated before):
- whole: `whole_outputs` (the logits once, kept by autograd);
- chunked: `token_outputs` in chunks of the size the device rule takes when it chunks
  (planning/output_layer.py fitting_chunk, for the memory free now);
- cpu_budget: `token_outputs` in chunks of the CPU's fixed 256 MiB budget (432 tokens here), the
  output layer before the device rule;
- auto: what the engines now do (output_chunk with the memory free now): at 8 x 4,096 the whole
  logits need ~30 bytes a logit (149 GB), more than a 141 GB board, so the rule chunks;
- chunked_fp32gemm / auto_fp32gemm: the same chunks with the weight gradient's GEMM in fp32 (both
  operands upcast: engines/logits.py WEIGHT_GRAD_GEMM = "fp32", the form before issue 85) against
  the bf16 operands with an fp32 result the engines now run;
- auto_logprobs (8 x 4,096): an update that reads log-probs alone, as the rule charges it (13 bytes
  a logit: the whole logits where they fit half the free memory), which must not run out of memory;
- chunked_fused / auto_fused: the same chunks with their elementwise work compiled by
  torch.compile (engines/logits_fused.py; not yet the engines' default: this measures it; eager in
  the CPU rehearsal);
- liger: Liger's fused linear cross-entropy for log-probs alone (where liger-kernel imports), a
  reference for the fastest log-prob-only path.
Exactness at 2 x 4,096: the chunked path's log-probs and entropy against the whole logits'.

Goals (issue 75): chunked / whole update time <= 1.1 at 2 x 4,096; at 8 x 4,096 no out-of-memory.
A path that runs out of memory is reported as such (not an error); exit 1 on any other error.
--cpu-rehearsal: V = 2,048, hidden 32, 2 x 128 and 8 x 128 tokens, fp32, a pretended 16 MiB free:
the same code, no performance claim.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

GOAL_CHUNKED_OVER_WHOLE = 1.1
FP32_GEMM = "_fp32gemm"  # a path's suffix: the weight gradient's GEMM with fp32 operands (the form before issue 85)
LONG_ROWS = 8  # the long case's rows (GPU and rehearsal alike)
GPU = {"vocab": 151936, "hidden": 1024, "rows": (2, 8), "seq": 4096, "dtype": "bfloat16", "iters": 5}
REHEARSAL = {"vocab": 2048, "hidden": 32, "rows": (2, 8), "seq": 128, "dtype": "float32", "iters": 1,
             "free": 16 << 20}


def _update(fn, hidden, weight, targets):
    out = fn(hidden, weight, targets)
    (out["log_probs"].sum() + 0.01 * out["entropy"].sum()).backward()
    hidden.grad = weight.grad = None
    return out


def measure(name, fn, hidden, weight, targets, iters, device) -> dict:
    """Median seconds and peak bytes of `iters` updates after one warm-up; {"oom": ...} on OOM. A
    name ending in FP32_GEMM runs with the weight gradient's fp32 GEMM form (logits.WEIGHT_GRAD_GEMM),
    forward and backward."""
    from verl_hpc.engines import logits

    form = logits.WEIGHT_GRAD_GEMM
    logits.WEIGHT_GRAD_GEMM = "fp32" if name.endswith(FP32_GEMM) else "low"
    try:
        return _measure(name, fn, hidden, weight, targets, iters, device)
    finally:
        logits.WEIGHT_GRAD_GEMM = form


def _measure(name, fn, hidden, weight, targets, iters, device) -> dict:
    import torch

    from verl_hpc.runtime.device import peak_memory_allocated, release_cached_memory, reset_peak_memory, synchronize

    release_cached_memory()
    reset_peak_memory()
    before = peak_memory_allocated()
    try:
        _update(fn, hidden, weight, targets)
        reset_peak_memory()
        times = []
        for _ in range(iters):
            synchronize()
            t = time.perf_counter()
            _update(fn, hidden, weight, targets)
            synchronize()
            times.append(time.perf_counter() - t)
    except torch.OutOfMemoryError as e:
        release_cached_memory()
        return {"path": name, "oom": str(e).splitlines()[0][:200]}
    peak = peak_memory_allocated()
    return {"path": name, "median_s": statistics.median(times), "iters": len(times),
            "peak_bytes": None if peak is None else peak - before}


def run(args, progress=lambda result: None) -> dict:
    """The measurements; `progress(result)` after each path (the JSON so far: a run stopped from
    outside keeps what it measured, the compiled paths come last in each case)."""
    import torch

    from verl_hpc.engines.logits import device_free_bytes, token_outputs, whole_outputs
    from verl_hpc.planning.output_layer import cpu_chunk, fitting_chunk, output_chunk
    from verl_hpc.runtime.device import describe_accelerator, has_gpu

    from verl_hpc.engines import logits_fused

    rehearsal = args.cpu_rehearsal
    if not rehearsal and not has_gpu():
        raise RuntimeError("no CUDA device here: run with --cpu-rehearsal to test the script on CPU")
    logits_fused.COMPILE = not rehearsal  # the rehearsal runs the fused functions eagerly (cheap)
    cfg = REHEARSAL if rehearsal else GPU
    device = torch.device("cpu" if rehearsal else "cuda")
    dtype = getattr(torch, cfg["dtype"])
    act = torch.empty((), dtype=dtype).element_size()
    v, h = cfg["vocab"], cfg["hidden"]
    g = torch.Generator(device=device).manual_seed(0)
    weight = (0.02 * torch.randn(v, h, generator=g, device=device)).to(dtype).requires_grad_()

    def free():
        return cfg["free"] if rehearsal else device_free_bytes(device)

    start = time.perf_counter()
    cases = []
    result = {"ok": True, "mode": "cpu-rehearsal" if rehearsal else "gpu",
              "device": "cpu" if rehearsal else describe_accelerator(), "vocab": v, "hidden": h,
              "dtype": cfg["dtype"], "cases": cases}

    def report():
        result.update(goals=goals(cases, rehearsal), elapsed_s=time.perf_counter() - start)
        progress(result)
    for rows in cfg["rows"]:
        n = rows * cfg["seq"]
        hidden = torch.randn(n, h, generator=g, device=device).to(dtype).requires_grad_()
        targets = torch.randint(0, v, (n,), generator=g, device=device)
        f = free()
        chunk = fitting_chunk(n, v, act, f)
        auto = output_chunk(None, v, n, act, f)
        paths = {
            "whole": lambda hd, w, t: whole_outputs(hd, w, t, ("log_probs", "entropy")),
            "chunked": lambda hd, w, t, c=chunk: token_outputs(hd, w, t, ("log_probs", "entropy"), chunk=c),
            "cpu_budget": lambda hd, w, t, c=cpu_chunk(v): token_outputs(hd, w, t, ("log_probs", "entropy"), chunk=c),
            "auto": (lambda hd, w, t, c=auto: token_outputs(hd, w, t, ("log_probs", "entropy"), chunk=c) if c
                     else whole_outputs(hd, w, t, ("log_probs", "entropy"))),
            "chunked_fused": lambda hd, w, t, c=chunk: token_outputs(hd, w, t, ("log_probs", "entropy"), chunk=c,
                                                                     fused=True),
        }
        # the same chunks with the fp32 GEMM form (measure() sets it by the name), before the compiled path
        fused = paths.pop("chunked_fused")
        paths["chunked" + FP32_GEMM], paths["chunked_fused"] = paths["chunked"], fused
        lp_auto = output_chunk(None, v, n, act, f, want=("log_probs",))
        if rows == max(cfg["rows"]):  # the long case: the engines' own path (both GEMM forms), then fused
            paths = {"auto": paths["auto"]}
            if auto:
                paths["auto" + FP32_GEMM] = paths["auto"]
            # an update without entropy, as the rule charges it (13 bytes a logit: the whole logits
            # where they fit half the free memory), which must not run out of memory either
            paths["auto_logprobs"] = (lambda hd, w, t, c=lp_auto: _log_probs_only(
                token_outputs(hd, w, t, ("log_probs",), chunk=c) if c else whole_outputs(hd, w, t, ("log_probs",))))
            if auto:
                paths["auto_fused"] = (lambda hd, w, t, c=auto: token_outputs(hd, w, t, ("log_probs", "entropy"),
                                                                              chunk=c, fused=True))
        case = {"rows": rows, "tokens": n, "free_bytes": f, "chunk": chunk, "auto_chunk": auto,
                "auto_logprobs_chunk": lp_auto, "results": []}
        for name, fn in paths.items():
            if time.perf_counter() - start > args.time_limit:
                case["results"].append({"path": name, "skipped": "out of time"})
                continue
            case["results"].append(measure(name, fn, hidden, weight, targets, cfg["iters"], device))
            if case not in cases:
                cases.append(case)
            report()
        if rows == min(cfg["rows"]):
            with torch.no_grad():
                w_out = whole_outputs(hidden, weight, targets, ("log_probs", "entropy"))
                c_out = token_outputs(hidden, weight, targets, ("log_probs", "entropy"), chunk=chunk)
            case["max_abs_diff"] = {k: float((w_out[k] - c_out[k]).abs().max()) for k in w_out}
        liger = _liger_case(hidden, weight, targets, cfg["iters"], device, rehearsal)
        if liger:
            case["results"].append(liger)
        if case not in cases:
            cases.append(case)
        report()
        del hidden, targets
    return result


def _log_probs_only(out):
    """An update without an entropy term: the loss reads log-probs alone (the entropy's 0.01 weight
    multiplies nothing that needs a gradient)."""
    return {"log_probs": out["log_probs"], "entropy": out["log_probs"].new_zeros(())}


def _liger_case(hidden, weight, targets, iters, device, rehearsal):
    from verl_hpc.engines.fsdp.liger import liger_installed

    if rehearsal or not liger_installed():
        return None
    from verl_hpc.engines.fsdp.liger import liger_log_probs

    def fn(hd, w, t):
        lp = liger_log_probs(hd, w, t, 1.0)
        return {"log_probs": lp, "entropy": lp.new_zeros(())}

    return measure("liger (log-probs only)", fn, hidden, weight, targets, iters, device)


def _result(case, path):
    return next((r for r in case["results"] if r["path"] == path), {})


def goals(cases, rehearsal: bool) -> dict:
    short, long = cases[0], cases[-1] if len(cases) > 1 else {"results": []}
    w, c = _result(short, "whole"), _result(short, "chunked")
    ratio = c["median_s"] / w["median_s"] if "median_s" in w and "median_s" in c else None
    auto = _result(long, "auto")
    note = "CPU rehearsal: no performance claim" if rehearsal else ""
    return {
        "chunked_over_whole": {"goal": GOAL_CHUNKED_OVER_WHOLE, "value": ratio,
                               "met": None if rehearsal or ratio is None else ratio <= GOAL_CHUNKED_OVER_WHOLE,
                               "note": note or ("" if ratio is not None else f"whole: {w}, chunked: {c}")},
        "long_no_oom": {"goal": "runs", "value": "oom" if "oom" in auto else ("ran" if "median_s" in auto else None),
                        "met": None if rehearsal or not auto or "skipped" in auto else ("median_s" in auto),
                        "note": note or auto.get("oom", "") or ("" if auto else "not measured (the run stopped)")},
    }


def goal_lines(r: dict) -> list:
    g = r["goals"]
    c, o = g["chunked_over_whole"], g["long_no_oom"]
    met = (lambda m: {True: "PASS", False: "FAIL", None: "NOT EVALUATED"}[m])
    short = r["cases"][0]
    long = r["cases"][1] if len(r["cases"]) > 1 else {"rows": LONG_ROWS, "tokens": LONG_ROWS * short["tokens"] // short["rows"]}
    return [f"goal: output layer at V = {r['vocab']:,}, {short['rows']} x {short['tokens'] // short['rows']:,}: "
            f"chunked update <= {c['goal']}x the whole logits': "
            + ("-" if c["value"] is None else f"{c['value']:.2f}x") + f" {met(c['met'])}"
            + (f" ({c['note']})" if c["note"] else ""),
            f"goal: output layer at V = {r['vocab']:,}, {long['rows']} x {long['tokens'] // long['rows']:,}: no "
            f"out-of-memory: {o['value'] or '-'} {met(o['met'])}" + (f" ({o['note']})" if o["note"] else "")]


def table(r: dict) -> str:
    gb = (lambda b: "-" if b is None else f"{b / 1e9:.2f}")
    lines = [f"bench_gpu_logits ({r['mode']}): {r['device']}; V = {r['vocab']:,}, hidden {r['hidden']}, {r['dtype']}"]
    for case in r["cases"]:
        lines.append(f"{case['rows']} x {case['tokens'] // case['rows']} tokens: free {gb(case['free_bytes'])} GB, "
                     f"the rule's chunk {case['chunk']} tokens, auto: "
                     + ("the whole logits" if case["auto_chunk"] == 0 else f"chunks of {case['auto_chunk']}")
                     + "; log-probs alone: " + ("the whole logits" if not case.get("auto_logprobs_chunk")
                                                 else f"chunks of {case['auto_logprobs_chunk']}"))
        for res in case["results"]:
            if "median_s" in res:
                lines.append(f"  {res['path']:<24} {res['median_s']:.4f} s  peak {gb(res['peak_bytes'])} GB")
            else:
                lines.append(f"  {res['path']:<24} {('OUT OF MEMORY: ' + res['oom']) if 'oom' in res else res.get('skipped')}")
        if "max_abs_diff" in case:
            lines.append("  chunked vs whole, max |diff|: " + ", ".join(f"{k} {v:.2g}" for k, v in case["max_abs_diff"].items()))
    lines += goal_lines(r)
    lines.append(f"elapsed {r['elapsed_s']:.0f} s")
    return "\n".join(lines)


def main(argv=None) -> int:
    import os

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cpu-rehearsal", action="store_true", help="tiny shape on CPU: tests this script")
    ap.add_argument("--out", default=str(REPO / "outputs" / "bench_gpu_logits"))
    ap.add_argument("--time-limit", type=float, default=120.0, help="no new path starts after this many seconds")
    args = ap.parse_args(argv)
    if args.cpu_rehearsal:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    Path(args.out).mkdir(parents=True, exist_ok=True)
    path = Path(args.out) / "bench_gpu_logits.json"
    def progress(result):
        path.write_text(json.dumps(dict(result, goal_lines=goal_lines(result)), indent=2))

    try:
        result = run(args, progress)
    except Exception as e:
        path.write_text(json.dumps({"ok": False, "error": f"{type(e).__name__}: {e}",
                                    "traceback": traceback.format_exc()}, indent=2))
        print(f"bench_gpu_logits: FAILED: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    result["goal_lines"] = goal_lines(result)  # what `make gpu-all`'s summary prints
    path.write_text(json.dumps(result, indent=2))
    print(table(result))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
