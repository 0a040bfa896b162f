"""Checkpoint and resume: what a checkpoint holds per rank, commit markers and the checkpoint a restart resumes from."""
