"""Preflight stages: checks that run before ``train`` so that it never starts on a broken setup.

- ``env_check``: versions, devices against the topology, compiler, writable directories, free disk.
- ``smoke_imports``: the stages' import lines, then one forward and training step per attention backend.
- ``race``: the torch.compile FX-tracing race in threads, reproduced and its mitigation verified.
- ``warmup``: the drafter's training step compiled into a persistent cache, cold and warm start timed.

Each stage returns a verdict (``dflash.preflight.verdict``) that ``cli`` writes
as ``results/preflight/*.json`` with a one-line summary. Submodules are not
imported here: each stage pays only for what it uses.
"""
