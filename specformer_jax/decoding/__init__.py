"""Decoding: the on-device loops (autoregressive.py, speculative.py), running them in batches (runner.py), the
`generate` entry point (api.py), and the draft length: tuner.py with its cost model, records and timing harness."""
