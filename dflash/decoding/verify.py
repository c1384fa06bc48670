"""The verify step: one target forward over the last committed token and a proposal (a chain, or a tree under its
attention mask), the path of draft tokens the target accepts, and its cache cut to that path."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from dflash.decoding.proposal import token_depths
from dflash.target import Target


def tree_mask(parents: list[int], past: int, device: torch.device) -> torch.Tensor:
    """The verify's attention mask ``[1, 1, n + 1, past + n + 1]`` (True: attend) for the last committed token and a
    tree of n draft tokens: every position sees the cached context, itself and its ancestors."""
    n = len(parents)
    sees = torch.eye(n + 1, dtype=torch.bool)
    sees[:, 0] = True
    for i, parent in enumerate(parents):
        sees[i + 1] |= sees[parent + 1]
    return torch.cat([torch.ones(n + 1, past, dtype=torch.bool), sees], dim=1)[None, None].to(device)


def accepted_path(draft: list[int], parents: list[int], verified: list[int]) -> list[int]:
    """The draft tokens (by index) the target accepts: from the last committed token, each time the child whose token
    is the target's next one (``verified[j]``: its token after block position j, the last committed token at 0)."""
    path, node = [], -1
    while True:
        child = next((i for i, token in enumerate(draft) if parents[i] == node and token == verified[node + 1]), None)
        if child is None:
            return path
        path.append(child)
        node = child


def keep_accepted(cache: DynamicCache, start: int, keep: list[int]) -> None:
    """Keep the cache's first ``start`` positions and, of the block after them, positions ``keep`` (increasing)."""
    if keep == list(range(len(keep))):
        excess = cache.get_seq_length() - start - len(keep)
        if excess > 0:
            cache.crop(-excess)
        return
    index = torch.tensor(keep) + start
    for layer in cache.layers:  # the kept positions moved down in place (the indexing copies them first), the rest cut
        index = index.to(layer.keys.device)
        layer.keys[..., start : start + len(keep), :] = layer.keys[..., index, :]
        layer.values[..., start : start + len(keep), :] = layer.values[..., index, :]
    cache.crop(-(cache.get_seq_length() - start - len(keep)))


@dataclass
class Verified:
    """What a verify step decided: the tokens it commits (the accepted draft tokens and the target's own next one)."""

    committed: list[int]
    path: list[int]  # the accepted draft tokens, by index in the draft
    depths: list[int]  # per block position: its distance from the last committed token (0: that token)
    kept: int  # the block positions the caches keep: the last committed token and the accepted path
    hidden_states: tuple[torch.Tensor, ...] | None  # of the kept positions, where asked for
    seconds: float  # the target's forward, as decoding paid it


def verify(target: Target, cache: DynamicCache, last: int, start: int, draft: list[int], parents: list[int], hidden_states: bool) -> Verified:
    """Verify ``draft`` (its tokens' ``parents``, a prefix of a tree) after ``last``, the last committed token at
    position ``start``, which the target has not processed yet; ``cache`` keeps what is committed."""
    device = target.device
    chain = parents == list(range(-1, len(draft) - 1))
    depths = [0] + token_depths(parents)
    block = torch.tensor([[last] + draft], device=device)
    verifying = time.perf_counter()
    out = target.forward(
        block,
        cache,
        position_ids=(start + torch.tensor(depths, device=device))[None],
        attention_mask=None if chain else tree_mask(parents, start, device),
        output_hidden_states=hidden_states,
    )
    verified = out.logits[0].argmax(-1).tolist()  # on the host: the forward has finished
    seconds = time.perf_counter() - verifying
    path = accepted_path(draft, parents, verified)
    # The caches keep the last committed token and the accepted branch; the other block positions were rejected.
    keep = [0] + [i + 1 for i in path]
    keep_accepted(cache, start, keep)
    kept = out.hidden_states
    if kept is not None and keep[-1] != len(path):  # a branch off the block's first positions
        kept = tuple(h[:, keep] for h in kept)
    committed = [draft[i] for i in path] + [verified[path[-1] + 1 if path else 0]]
    return Verified(committed, path, depths, len(keep), kept, seconds)
