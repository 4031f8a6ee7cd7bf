"""Checkpoint sets on disk: which files make a set, Megatron args and environment, GPT and decoder loading."""
