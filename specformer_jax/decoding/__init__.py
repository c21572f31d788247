"""Decoding: the engine (pool.py: the slots on the device and their refill; chunk.py: rounds in fixed-length
chunks; speculative.py: drafting and verification; scheduler.py: the host's queue and schedules; plan.py and
runner.py: what compiles and what a run adds up to), the `generate` and `generate_stream` entry points (api.py),
and the draft length: tuner.py with its cost model, records and timing harness."""
