"""Memory (and rough time) planning of a job before it is queued; pure Python, no torch needed.

    plan = plan_job(cfg)                 # phase x component bytes per rank, host bytes per node
    print(full_report(plan)); plan.fits(margin=0.10)

`python -m verl_hpc.plan CONFIG` prints it; `python -m verl_hpc.submit` refuses a job whose plan
does not fit. docs/memory.md gives the formulas and their sources.
"""
from verl_hpc.planning.phases import COMPONENTS, PHASES, MemoryPlan, plan_job
from verl_hpc.planning.report import MARGIN, full_report, refusal, verdict

__all__ = ["COMPONENTS", "MARGIN", "PHASES", "MemoryPlan", "full_report", "plan_job", "refusal",
           "verdict"]
