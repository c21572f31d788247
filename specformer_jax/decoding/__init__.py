"""Decoding, in layers from the bottom up: acceptance/ (token selection, choosing and verifying drafts, set
acceptance for cost measurements), engine/ (the pool of slots, rounds in fixed-length chunks, the host's queue and
schedules, what compiles and what a run adds up to), drafts/ (what a round drafts with: the SpecFormer drafter, n-gram
lookup, the per-row hybrid, and which of them a user's choice runs as), tuning/ (the draft length: the default, the
tuner behind `--draft-len auto`, its cost model, records and timing harness), and at the top the entry points
`generate` and `generate_stream` (api.py) with their options (options.py), prompts (encode.py) and drafter names
(names.py)."""
