"""Checkpointing: the run directory's layout, resume points and their parts, shards, the lock, the
run-directory reader, and the manager the loop saves and loads through."""
