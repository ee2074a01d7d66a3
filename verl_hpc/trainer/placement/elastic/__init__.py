"""Elastic rollout (issue 53, being built): rollout workers that join a running split-placement run
as Slurm jobs of their own and leave without ending it.

- ledger.py: the book of which samples are wanted, leased to which worker until when, and done;
  exactly once, whatever joins, leaves or straggles.
- pool.py: who is in the pool, their heartbeats, joins and leaves with reasons, and the rule that
  stops the run when too few workers remain for too long.
"""
