"""What a round drafts with: the SpecFormer drafter as a draft source (draft_source.py), n-gram lookup over the
row's own tokens (ngram.py), the per-row hybrid of the two (hybrid.py), and which source a user's choice runs as
(kinds.py)."""
