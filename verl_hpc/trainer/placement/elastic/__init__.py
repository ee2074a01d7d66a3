"""Elastic rollout (issue 53, being built): rollout workers that join a running split-placement run
as Slurm jobs of their own and leave without ending it.

- ledger.py: the book of which samples are wanted, leased to which worker until when, and done;
  exactly once, whatever joins, leaves or straggles.
- pool.py: who is in the pool, their heartbeats, joins and leaves with reasons, and the rule that
  stops the run when too few workers remain for too long.
- rendezvous.py: the file in the run's folder through which a worker finds the run (its store, its
  epoch, whether it still runs, the config a worker must share), and why a worker cannot join.
- channel.py: the weights to each worker over a two-rank group of its own with the first training
  rank (no communicator over the pool to rebuild at every join and leave).

Not wired into a job yet: the rollout leader's loop, the worker program and `submit --join` come next.
"""
