"""The engine: the static options of its compiled functions (plan.py), the pool of slots on the device (pool.py), a
round and the chunk of rounds (chunk.py), the host's queue and schedules (scheduler.py), and what compiles and what a
run adds up to (runner.py)."""
