"""The HF rollout engine: transformers' `generate` behind the rollout contract, for machines
without vLLM and for what vLLM cannot run here.

- engine.py   `HFRollout` (each rank one replica; vLLM's log-prob semantics)
- routes.py   routing replay's record side: each generated token's experts per MoE layer
- judge.py    a generative judge on transformers (rewards/judge.py)
"""
