"""Decoding: the engine (pool.py: the slots on the device and their refill; chunk.py: rounds in fixed-length
chunks; draft_source.py: what a round drafts with; speculative.py: choosing and verifying drafts; scheduler.py: the
host's queue and schedules; plan.py and runner.py: what compiles and what a run adds up to), the `generate` and
`generate_stream` entry points (api.py, where the draft length is resolved), and the draft length's tuner: tuner.py
with its cost model, records and timing harness. set_acceptance.py is the acceptance rule of cost measurements."""
