"""The vLLM rollout engine: an in-process `vllm.LLM` per inference tensor-parallel group.

- engine.py       `VLLMRollout`, the rollout contract (rollout/engine.py) on vLLM: generate, weight
                  reload (full, sliced, delta, LoRA adapters), sleep/wake, the drafter's sync
- compat.py       what an in-process vLLM changes in a training process, and the CPU workarounds,
                  each pinned to the vLLM version it was written for (docs/platform-notes.md)
- cpu_moe.py, cpu_spec.py   two CPU-only workarounds compat.py installs (expert reload, the
                  rejection sampler's expand kernel)
- support.py, registry.py, probe.py   whether vLLM can serve a model folder here, asked of vLLM
                  itself before the queue
- transformers_backend.py   vLLM's Transformers modelling backend inside a training process
- judge.py        a generative judge on a second vLLM engine (rewards/judge.py)

Importing this package imports no vLLM; each module imports it where an engine is built.
"""
