"""What the ranks run, by kind (docs/architecture.md, "The trainer"):

- programs/: the training programs (`trainer.job`: rl, sft, dpo, smoke) on one loop (programs/base.py)
  and the `make demo` driver;
- stages/: the RL step's stages (sampling, scoring, the typed StepBatch, corrections, advantages,
  PRIME's PRM stage, the rollout's weights);
- hooks/: the loop and what runs after each step (validation, task weights, rollback, stop rule,
  the non-finite guard, safety switches);
- placement/: where generation runs (colocated, or split: the async link and the rollout worker);
- roles.py: who takes part (the tokenizer, the rollout engine, the engine roles).
"""
