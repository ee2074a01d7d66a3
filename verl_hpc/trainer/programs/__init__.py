"""The training programs (`trainer.job`): each a StepProgram on one loop (base.py)."""
