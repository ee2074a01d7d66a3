"""Imported last by the ranks' fork server (tests/rank_launcher.py, PRELOAD): freezes what the
server has imported (torch, transformers, Megatron-Core: about a million objects), as Python's `gc`
documentation advises before forking. A forked rank's full collections (Megatron's teardown, the
rank scripts' memory measurements, the job's end) then walk what the rank made, not the libraries,
and do not touch the shared pages' reference counts."""
import gc

gc.collect()
gc.freeze()
