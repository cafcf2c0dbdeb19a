"""Sharded checkpoints under any plan: the files and their sealed manifests, the plan of which rank writes and
reads which slices, the lock that keeps two jobs from writing one directory, and ``load_checkpoint``."""
