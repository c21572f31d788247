"""The draft length: decided in one place (draft_len.py: the user's k, the measured default or auto's choice),
`--draft-len auto`'s tuner (tuner.py) with its cost model (cost_model.py), the decoding records it reads (records.py)
and the harness that times the engine (timing.py)."""
