"""The math of a round: token selection (sampling.py), choosing drafts and verifying them against the target
(speculative.py), and set acceptance, the acceptance rule of cost measurements (set_acceptance.py)."""
