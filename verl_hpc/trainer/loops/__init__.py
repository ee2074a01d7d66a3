"""Schedules of the RL step's pieces. Colocated (every rank in turn) is RLTrainer.fit itself; split
placement runs the rollout ranks' loop (rollout_worker.py) beside the same trainer, which takes its
batches from the rollout group (async_link.py) and publishes its weights to it (remote.py)."""
