"""The draft length: `--draft-len auto`'s tuner (tuner.py) with its cost model (cost_model.py), the decoding records
it reads (records.py) and the harness that times the engine (timing.py)."""
