"""Lossless speculative decoding, one module per part:

generate.py     the loop: prefill, propose, verify, commit (``speculative_generate``)
verify.py       one verify step: the target's forward over a block or tree, the accepted path, the cache cut to it
proposal.py     what a proposer drafts (``Proposal``, a chain or a tree) and the ``Proposer`` protocol
drafter.py      the DFlash drafter as a proposer
lookup.py       prompt lookup as a proposer, and its confidence
gate.py         the gate: the verify cost it decides with, what it decides (``GatedProposer``; the hybrid is a
                gate over the drafter and prompt lookup)
calibration.py  the drafter's confidence, fitted on validation data
arms.py         an evaluation's arms as data, and the registry of proposers they name
stats.py        what a decoding did, step by step
"""
