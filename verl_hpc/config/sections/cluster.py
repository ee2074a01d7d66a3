"""`parallel:` the training layout; `slurm:` the allocation and how ranks are started."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional

from verl_hpc.config.fields import Section, opt, section
from verl_hpc.config.sbatch_text import sbatch_text_problems

FAULT_ENV = "VERL_HPC_FAULT"  # runtime/faults.py's variable (a test keeps the two names equal)

@dataclass
class ParallelConfig(Section):
    tp: int = opt(1, "tensor parallel", check=">0")
    pp: int = opt(1, "pipeline parallel", check=">0")
    vpp: Optional[int] = opt(None, "virtual pipeline stages per rank (interleaved schedule), needs pp > 1")
    cp: int = opt(1, "context parallel (Megatron engine): each sequence split over cp ranks in 2 * cp "
                     "load-balanced chunks (padded to a multiple of 2 * cp); needs Transformer Engine "
                     "attention (GPUs); data parallel = training ranks / (tp * cp * pp)", check=">0")
    ep: int = opt(1, "expert parallel (mixture-of-experts models): experts split over ep ranks of a stage's "
                     "tp * dp ranks", check=">0")
    etp: Optional[int] = opt(None, "expert tensor parallel: each expert's FFN split over etp ranks; null = tp",
                             check=">0")
    sequence_parallel: bool = opt(False, "splits activations across the TP group; needs tp > 1")
    use_distributed_optimizer: bool = opt(True, "shard optimizer states over data parallel")
    overlap_grad_reduce: Optional[bool] = opt(None, "DP gradient reduce during backward; auto: on with GPUs")
    overlap_param_gather: Optional[bool] = opt(
        None, "distributed optimizer's param all-gather during forward; auto: on with GPUs")
    recompute_granularity: str = opt("none", "activation recompute: selective (attention core) | full (whole layers)",
                                     choices=("none", "selective", "full"))
    recompute_method: str = opt("uniform", "full only: uniform (units of recompute_num_layers) | block (first N layers)",
                                choices=("uniform", "block"))
    recompute_num_layers: int = opt(1, "full only: layers per unit (uniform) or recomputed layers per stage (block)",
                                    check=">0")
    engine: str = opt("megatron", "training engine of every role: megatron (Megatron-Core TP/PP/EP; the "
                                  "mapped Llama/Qwen2/Mistral/MoE families) | fsdp (PyTorch FSDP2: any "
                                  "transformers model) | auto (per role's model folder: megatron where it is "
                                  "mapped and tp/pp/ep > 1, else fsdp)", choices=("auto", "megatron", "fsdp"))
    backend: str = opt("auto", "auto (nccl with GPUs, else gloo) | nccl | gloo", choices=("auto", "nccl", "gloo"))

    def check(self, job) -> List[str]:
        p = job.layout.problems() if self.tp > 0 and self.pp > 0 else []
        if job.slurm.gpus_per_node == 0 and self.backend == "nccl":
            p.append("parallel.backend = nccl needs GPUs, but slurm.gpus_per_node = 0 (a CPU job): use gloo or auto")
        if self.sequence_parallel and job.slurm.gpus_per_node == 0:
            p.append("parallel.sequence_parallel needs the Transformer Engine layer spec (GPUs), but "
                     "slurm.gpus_per_node = 0 (a CPU job): Megatron's torch norm of the local spec does "
                     "not support it; set parallel.sequence_parallel=false")
        if self.overlap_param_gather and not self.use_distributed_optimizer:
            p.append("parallel.overlap_param_gather = true needs parallel.use_distributed_optimizer = true "
                     "(only the distributed optimizer all-gathers parameters)")
        p += self._cp_problems(job)
        if self.sequence_parallel and self.tp <= 1:
            p.append(f"parallel.sequence_parallel needs parallel.tp > 1 (got {self.tp}): it splits activations "
                     "across the tensor-parallel group")
        return p

    def _cp_problems(self, job) -> List[str]:
        """Megatron-Core's context parallelism: its engine only, its attention only in Transformer
        Engine (GPUs). The sequence rule (each sequence a multiple of 2 * cp tokens) needs no
        check: the engine pads every micro-batch to it (engines/megatron/context_parallel.py)."""
        if self.cp <= 1:
            return []
        p = []
        if self.engine != "megatron":
            p.append(f"parallel.cp = {self.cp} needs parallel.engine = megatron (got {self.engine}): it is "
                     "Megatron-Core's context parallelism; on the FSDP engine split long sequences with "
                     "fsdp.sp (Ulysses)")
        if job.slurm.gpus_per_node == 0:
            p.append(f"parallel.cp = {self.cp} needs Transformer Engine's attention (GPUs), but "
                     "slurm.gpus_per_node = 0 (a CPU job): Megatron's local attention refuses context "
                     "parallelism; set parallel.cp=1")
        return p


@dataclass
class ContainerConfig(Section):
    runtime: str = opt("none", "container runtime of the ranks", choices=("none", "apptainer", "pyxis", "charliecloud"))
    image: str = opt("", "image (a .sif file, a squashfs or a registry name)")
    mounts: List[str] = opt([], "\"src:dst\" bind mounts")
    extra_args: List[str] = opt([], "extra arguments to the container runtime, one per item (each passed quoted)")

    def check(self, job) -> List[str]:
        if self.runtime != "none" and not self.image:
            return [f"slurm.container.image: empty, but slurm.container.runtime = {self.runtime} needs one"]
        return []


@dataclass
class SlurmConfig(Section):
    nodes: int = opt(1, "world size = nodes * tasks_per_node; with placement.rollout_partition (a heterogeneous "
                        "job) the training nodes only, the rollout nodes come in addition", check=">0")
    tasks_per_node: int = opt(2, "ranks per node; one per GPU on GPU clusters", check=">0")
    gpus_per_node: int = opt(0, "0 = CPU job", check=">=0")
    gpu_type: str = opt("", "h100-80gb | h200 | a100-80gb | ...: the memory plan's limit (\"\" = --gpu-memory-gb)")
    cpus_per_task: int = opt(1, "CPU cores per rank", check=">0")
    mem_gb: int = opt(0, "0 = not requested", check=">=0")
    time_min: int = opt(60, "time limit in minutes", check=">0")
    partition: str = opt("", "")
    account: str = opt("", "")
    qos: str = opt("", "")
    constraint: str = opt("", "")
    exclusive: bool = opt(False, "whole nodes")
    job_name: str = opt("verl_hpc", "")
    log_dir: str = opt("${trainer.output_dir}/slurm/%j", "submitit logs, next to the run; %j = the Slurm job id")
    # sbatch takes --signal=...@N for N in [0, 65535] only
    signal_delay_s: int = opt(120, "Slurm's warning signal (checkpoint + requeue) this long before the limit",
                              check="[0, 65535]")
    requeue: bool = opt(True, "let the job requeue itself on the warning signal, and when a lost node leaves too few "
                              "nodes for the layout")
    # docs/resilience.md, "A rank that dies": the batch script's supervisor (launcher/restart_loop.py)
    # and the local submitter relaunch the ranks from `latest` inside the same allocation
    max_restarts: int = opt(2, "in-allocation restarts after a rank dies (a signal, a stall, a lost heartbeat or "
                               "node), each from the latest checkpoint; 0 = none (a dead rank ends the job)",
                            check="[0, 100]")
    restart_backoff_s: float = opt(10.0, "seconds before the first restart, doubled for each further one (at most 300)",
                                   check="[0, 3600]")
    spare_nodes: int = opt(0, "nodes allocated beyond slurm.nodes: a node whose ranks died in two launches, or that "
                              "Slurm lost, is left out and a spare takes its place (needs slurm.max_restarts > 0)",
                           check="[0, 1024]")
    container: ContainerConfig = section(ContainerConfig)
    env: Dict[str, str] = opt({}, "environment added to / overriding the job's, e.g. {NCCL_SOCKET_IFNAME: ib0}")
    setup: List[str] = opt([], "shell lines run before srun, as written (your own shell code), e.g. [\"module load cuda/12.4\"]")
    additional: Dict[str, str] = opt({}, "extra #SBATCH options the plan does not set, e.g. {reservation: mine}")

    @property
    def world_size(self) -> int:
        return self.nodes * self.tasks_per_node

    def _restart_problems(self, job) -> List[str]:
        p = []
        if self.spare_nodes and not self.max_restarts:
            p.append(f"slurm.spare_nodes = {self.spare_nodes} with slurm.max_restarts = 0: a spare node only "
                     "serves a restart; set slurm.max_restarts > 0 or slurm.spare_nodes = 0")
        if self.spare_nodes and job.placement.hetjob:
            p.append(f"slurm.spare_nodes = {self.spare_nodes} with placement.rollout_partition = "
                     f"{job.placement.rollout_partition!r}: a heterogeneous job's components have no spare "
                     "nodes; set slurm.spare_nodes = 0")
        return p

    @property
    def world_words(self) -> str:
        return f"the world size {self.world_size} (slurm.nodes {self.nodes} * slurm.tasks_per_node {self.tasks_per_node})"

    def check(self, job) -> List[str]:
        p = []
        if self.gpus_per_node > 0 and self.tasks_per_node > self.gpus_per_node:
            p.append(f"slurm.tasks_per_node = {self.tasks_per_node} is more than slurm.gpus_per_node = "
                     f"{self.gpus_per_node}: more ranks than GPUs requested (one rank per GPU)")
        if self.gpu_type:
            from verl_hpc.config.gpus import GPU_ALIASES, GPUS, gpu_type

            if gpu_type(self.gpu_type) is None:
                p.append(f"slurm.gpu_type = {self.gpu_type!r} is not a known GPU; valid: "
                         f"{', '.join(sorted([*GPUS, *GPU_ALIASES]))} (or leave it empty and pass --gpu-memory-gb)")
        if self.time_min > 0 and self.signal_delay_s >= self.time_min * 60:
            p.append(f"slurm.signal_delay_s = {self.signal_delay_s} is not shorter than slurm.time_min = "
                     f"{self.time_min} minutes")
        if FAULT_ENV in self.env:  # the resilience tests' hook (runtime/faults.py), never a job's setting
            p.append(f"slurm.env.{FAULT_ENV}: the fault-injection test hook cannot be set in a config; valid: "
                     "remove it (tests set it in the environment of the submitter)")
        p += self._restart_problems(job)
        return p + sbatch_text_problems(self)  # no newline may reach the sbatch script
