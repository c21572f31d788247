"""Benchmarks: AR vs speculative decoding on the same prompts, in one process, with device facts."""
