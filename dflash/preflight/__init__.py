"""Preflight stages: checks that run before ``train`` so that it never starts on a broken setup.

- ``env_check``: versions, devices against the topology, compiler, writable directories, free disk.
- ``smoke_imports``: the stages' import lines, then one forward and training step per attention backend.
- ``race``: the torch.compile FX-tracing race in threads (``fx_race``: its mechanism and mitigation), reproduced and the mitigation verified.
- ``gate``: what ``train`` requires of the verdicts; the device names of the per-device stages.
- ``warmup``: the drafter's training step compiled into a persistent cache, cold and warm start timed.

Each stage returns a verdict (``dflash.preflight.verdict``) that ``dflash.cli`` writes
as ``results/preflight/*.json`` with a one-line summary. Submodules are not
imported here: each stage pays only for what it uses.
"""
