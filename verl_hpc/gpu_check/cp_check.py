"""The kit's context-parallel check: the Megatron engine at parallel.cp = 2 against cp = 1 on the
same two GPUs (NCCL), where Transformer Engine's attention exists (Megatron's CP runs nowhere else).

    python -m verl_hpc.gpu_check.cp_check WORKDIR   # one rank (torchrun's variables in its env)

Both ranks build the trainable engine twice on the kit's tiny model: at cp 1 (the two ranks are
data parallel 2) and at cp 2 (one sequence split over both: Megatron's load-balanced chunks,
engines/megatron/context_parallel.py). Each run records the log-probs and entropy of one batch of
long-ish rows, the loss of one update on it, and the log-probs after the update. `compare` holds
the verdict: the two layouts must agree on every response token within the bound, before and after
the step, and on the loss. The CPU rehearsal cannot run the engine at cp 2 (no Transformer Engine),
so the unit tests rehearse `compare` on made-up results (tests/unit/test_gpu_check.py).
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Dict, List

WORLD = 2
ROWS, PROMPT, RESPONSE = 4, 64, 192  # rows of 256 tokens: 4 chunks of 64 at cp 2


def _masked_max(a: List[List[float]], b: List[List[float]], lengths: List[int]) -> float:
    return max(abs(x - y) for ra, rb, n in zip(a, b, lengths) for x, y in zip(ra[:n], rb[:n]))


def compare(one: Dict, two: Dict, response_lengths: List[int], bound: float) -> str:
    """cp 1 (`one`) vs cp 2 (`two`) results of `_run`: raise AssertionError naming what differs, or
    say how close they are. The loss is compared relative to its size (the same bound)."""
    found = {}
    for key in ("log_probs", "entropy", "after_log_probs"):
        found[key] = _masked_max(one[key], two[key], response_lengths)
        assert math.isfinite(found[key]) and found[key] < bound, (
            f"cp 2 vs cp 1 {key}: max |diff| {found[key]:.3g} >= {bound} over the response tokens")
    rel = abs(one["loss"] - two["loss"]) / max(abs(one["loss"]), 1e-12)
    assert math.isfinite(rel) and rel < bound, (
        f"cp 2 vs cp 1 loss: {two['loss']:.6g} vs {one['loss']:.6g} (relative {rel:.3g} >= {bound})")
    moved = _masked_max(one["log_probs"], one["after_log_probs"], response_lengths)
    assert moved > found["after_log_probs"], (
        f"the update moved the log-probs by {moved:.3g}, no more than cp 2 and cp 1 differ: nothing compared")
    return (f"cp 2 vs cp 1 over {sum(response_lengths)} response tokens: log-probs max |diff| "
            f"{found['log_probs']:.3g}, entropy {found['entropy']:.3g}, after one update {found['after_log_probs']:.3g} "
            f"(the update moved them {moved:.3g}); loss relative {rel:.3g} (bound {bound})")


def _run(path: str, dtype: str, cp: int) -> Dict:
    from verl_hpc.engines.megatron import MegatronEngine
    from verl_hpc.gpu_check.workload import batch, loss_fn, train_options
    from verl_hpc.parallel import destroy_model_parallel, init_model_parallel

    mp = init_model_parallel(1, 1, cp=cp, seed=1234, timeout_minutes=5)
    assert (mp.cp, mp.dp) == (cp, WORLD // cp), (mp.cp, mp.dp)
    eng = MegatronEngine(train_options(path, dtype, use_distributed_optimizer=True))
    rows = batch(seed=3, rows=ROWS, prompt=PROMPT, response=RESPONSE)
    first = eng.forward(rows, ("log_probs", "entropy"))
    m = eng.train_step(rows, loss_fn)
    assert m["nonfinite"] == 0.0 and math.isfinite(m["loss"]), m
    after = eng.forward(rows, ("log_probs",))
    del eng
    destroy_model_parallel()
    return {"log_probs": first["log_probs"].float().tolist(), "entropy": first["entropy"].float().tolist(),
            "loss": float(m["loss"]), "after_log_probs": after["log_probs"].float().tolist(),
            "response_lengths": rows["response_lengths"].tolist()}


def _rank_main(work: Path) -> None:
    import torch.distributed as dist

    from verl_hpc.runtime.bootstrap import bootstrap, shutdown

    args = json.loads((work / "args.json").read_text())
    ctx = bootstrap(backend="gloo" if args["rehearsal"] else "nccl", timeout_s=300)
    result = {"device": str(ctx.device), "backend": ctx.backend,
              "cp1": _run(args["model_path"], args["dtype"], 1), "cp2": _run(args["model_path"], args["dtype"], 2)}
    (work / f"rank{dist.get_rank()}.json").write_text(json.dumps(result))
    shutdown()


if __name__ == "__main__":
    _rank_main(Path(sys.argv[1]))
