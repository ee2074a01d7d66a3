"""What runs after each step: the loop and its hooks (base.py), validation, task weights, rollback, stop rule, guards."""
