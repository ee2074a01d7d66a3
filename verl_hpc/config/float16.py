"""Whether this torch runs float16 on a CPU: the probe behind the fp16 checks of a CPU job (the
config's, verl_hpc/config/sections/model.py) and of an engine built on a machine without a GPU
(verl_hpc/engines/options.py: check_float16_here). torch is imported inside, for this case only:
the config package stays torch-free on a login node otherwise."""
from __future__ import annotations

import functools


def cpu_float16_problem(field: str, valid: str) -> str:
    """One line naming `field` where this torch lacks a CPU float16 kernel the engines use, else ""."""
    missing = cpu_float16_missing()
    if not missing:
        return ""
    import torch

    return (f"{field} needs torch's CPU float16 kernels, and this torch {torch.__version__} has no {missing}; "
            f"valid: {valid}, or run on GPUs")


@functools.lru_cache(maxsize=1)
def cpu_float16_missing() -> str:
    """The first CPU float16 operation the engines need that this torch cannot run ("" if none):
    matmul, SDPA, and the loss scaler's fused check-and-unscale (torch 2.13 has all three)."""
    import torch

    x = torch.ones(1, 2, 4, 8, dtype=torch.float16)
    probes = (("matmul", lambda: x @ x.transpose(-1, -2)),
              ("scaled_dot_product_attention", lambda: torch.nn.functional.scaled_dot_product_attention(x, x, x)),
              ("_amp_foreach_non_finite_check_and_unscale_", lambda: torch._amp_foreach_non_finite_check_and_unscale_(
                  [x.float().clone()], torch.zeros(1), torch.ones(1))))
    for name, run in probes:
        try:
            run()
        except (RuntimeError, NotImplementedError, AttributeError):
            return name
    return ""
