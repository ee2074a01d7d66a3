"""Elastic rollout (docs/elastic.md): rollout workers that join a running split-placement run as
Slurm jobs of their own and leave without ending it.

- ledger.py: the book of which samples are wanted, leased to which worker until when, and done;
  exactly once, whatever joins, leaves or straggles.
- pool.py: who is in the pool, their heartbeats, joins and leaves with reasons, and the rule that
  stops the run when too few workers remain for too long.
- rendezvous.py: the file in the run's folder through which a worker finds the run (its store, its
  epoch, whether it still runs, the config a worker must share), and why a worker cannot join.
- coordinator.py: the rollout leader's side: the book, the pool, and the workers' keys in the run's
  store (joins, requeues, leases, results, goodbyes).
- channel.py: the weights to each worker over a two-rank group of its own with the first training
  rank (no communicator over the pool to rebuild at every join and leave), each on a thread of its own.
- worker.py: the worker program (`python -m verl_hpc.submit --join RUN_DIR`).
"""
