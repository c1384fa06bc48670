import os

import pytest
import torch

from dflash.batch import epoch_order, global_batches, rank_slice
from dflash.metrics import validation_due
from dflash.objective import FrozenHeadCrossEntropy, decayed_loss, dpace_weights, sample_positions


def test_frozen_head_cross_entropy_matches_autograd_of_the_decayed_loss():
    torch.manual_seed(0)
    hidden = torch.randn(37, 16, requires_grad=True)
    head = torch.randn(50, 16)
    labels = torch.randint(0, 50, (37,))
    weights = torch.rand(37)
    total = weights.sum() * 1.3  # a normaliser other than the weights' own sum, as with sampled positions
    loss, predictions = FrozenHeadCrossEntropy.apply(hidden, head, labels, weights, total, 8)  # chunks of 8 rows
    loss.backward()
    chunked_grad = hidden.grad.clone()
    hidden.grad = None
    reference = decayed_loss(hidden @ head.t(), labels, weights, total)
    reference.backward()
    assert loss.item() == pytest.approx(reference.item(), rel=1e-6)
    torch.testing.assert_close(chunked_grad, hidden.grad, rtol=1e-5, atol=1e-7)
    assert torch.equal(predictions, (hidden @ head.t()).argmax(-1))


def test_frozen_head_cross_entropy_against_a_distribution_matches_autograd():
    """Distillation: each row's target is the target's top-k distribution; a one-hot distribution is the hard label."""
    torch.manual_seed(1)
    hidden = torch.randn(21, 16, requires_grad=True)
    head = torch.randn(40, 16)
    ids = torch.stack([torch.randperm(40)[:5] for _ in range(21)])
    probs = torch.softmax(torch.randn(21, 5), -1)
    weights, total = torch.rand(21), torch.tensor(7.0)
    loss, predictions = FrozenHeadCrossEntropy.apply(hidden, head, ids, weights, total, 4, probs)
    loss.backward()
    chunked_grad = hidden.grad.clone()
    hidden.grad = None
    log_probs = torch.log_softmax(hidden @ head.t(), -1)
    reference = -((log_probs.gather(1, ids) * probs).sum(1) * weights).sum() / total
    reference.backward()
    assert loss.item() == pytest.approx(reference.item(), rel=1e-6)
    torch.testing.assert_close(chunked_grad, hidden.grad, rtol=1e-5, atol=1e-7)
    assert torch.equal(predictions, (hidden @ head.t()).argmax(-1))
    labels = ids[:, 0]
    one_hot, _ = FrozenHeadCrossEntropy.apply(hidden, head, labels[:, None], weights, total, 4, torch.ones(21, 1))
    hard, _ = FrozenHeadCrossEntropy.apply(hidden, head, labels, weights, total, 4)
    assert one_hot.item() == pytest.approx(hard.item(), rel=1e-7)


def test_frozen_head_cross_entropy_reweighted_by_dpace_matches_autograd():
    """With ``reweight`` the loss is sum(CE · w(CE)) / total, its gradient that of CE with the weights held fixed."""
    torch.manual_seed(0)
    hidden = torch.randn(24, 16, requires_grad=True)
    head = torch.randn(50, 16)
    labels = torch.randint(0, 50, (24,))
    trained = torch.rand(6, 4) > 0.3

    def reweight(cross_entropy):
        return dpace_weights(cross_entropy.view(6, 4), trained, 0.5).flatten()

    total = torch.tensor(17.0)
    loss, _ = FrozenHeadCrossEntropy.apply(hidden, head, labels, torch.ones(24), total, 5, None, reweight)
    loss.backward()
    chunked_grad = hidden.grad.clone()
    hidden.grad = None
    cross_entropy = torch.nn.functional.cross_entropy(hidden @ head.t(), labels, reduction="none")
    reference = (cross_entropy * reweight(cross_entropy.detach())).sum() / total
    reference.backward()
    assert loss.item() == pytest.approx(reference.item(), rel=1e-6)
    torch.testing.assert_close(chunked_grad, hidden.grad, rtol=1e-5, atol=1e-7)


def test_sampled_positions_are_unbiased_and_cheaper():
    decay = torch.exp(-torch.arange(15.0) / 7.0)
    weights = torch.cat([torch.zeros(1), decay]).repeat(4, 1)  # 4 blocks of B=16, position 0 unweighted
    weights[3] = 0.0  # a padding block
    generator = torch.Generator().manual_seed(0)
    draws = torch.stack([sample_positions(weights, generator) for _ in range(4000)])
    assert set(draws.unique().tolist()) <= {0.0, 1.0}  # kept positions carry the max weight
    assert draws[:, 3].sum() == 0 and draws[:, :, 0].sum() == 0  # zero weight is never kept
    torch.testing.assert_close(draws.mean(0), weights, atol=0.03, rtol=0)
    kept_per_block = (draws[:, 0] > 0).sum(-1).float().mean()
    assert kept_per_block == pytest.approx(float(decay.sum()), abs=0.1)  # ~6.7 of 15 LM-head rows at γ=7


def test_sample_order_is_a_function_of_seed_and_epoch_only():
    assert epoch_order(10, seed=3, epoch=1) == epoch_order(10, seed=3, epoch=1)
    assert sorted(epoch_order(10, seed=3, epoch=1)) == list(range(10))
    assert epoch_order(10, seed=3, epoch=1) != epoch_order(10, seed=3, epoch=2)
    batches = global_batches(10, 4, seed=0, epoch=0)
    assert [len(b) for b in batches] == [4, 4, 2]
    assert sorted(i for b in batches for i in b) == list(range(10))
    shares = [rank_slice(batches[0], r, 3) for r in range(3)]
    assert sorted(i for s in shares for i in s) == sorted(batches[0])


def test_validation_rides_on_the_first_row_after_each_multiple():
    # Rows every 10 steps, validation every 25, 100 steps: rows 30, 50, 80, 100 (100 also as the last).
    rows = range(10, 101, 10)
    due = [done for previous, done in zip([0, *rows], rows) if validation_due(previous, done, every=25, total=100)]
    assert due == [30, 50, 80, 100]
    # A run that ends between multiples still validates at its end.
    assert validation_due(40, 45, every=25, total=45) and not validation_due(40, 45, every=25, total=90)


def test_cpu_threads_share_the_cores_among_local_processes(monkeypatch):
    """Snakemake's OMP_NUM_THREADS (1 under --cores 1) is ignored; DFLASH_CPU_THREADS overrides; never below 1."""
    from dflash.config import cpu_threads

    cores = len(os.sched_getaffinity(0))
    monkeypatch.delenv("DFLASH_CPU_THREADS", raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert cpu_threads() == cores
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(2 * cores))
    assert cpu_threads() == 1
    assert cpu_threads(local_processes=1) == cores
    monkeypatch.setenv("DFLASH_CPU_THREADS", "3")
    assert cpu_threads() == 3
    monkeypatch.setenv("DFLASH_CPU_THREADS", "two")
    with pytest.raises(ValueError, match="DFLASH_CPU_THREADS='two'"):
        cpu_threads()


def test_the_frozen_head_is_never_copied():
    """A bf16 head and fp32 hidden states (the drafter's RMSNorm returns fp32): chunks are cast to the head's dtype,
    never the head to theirs. An 8B target's head is 2.5 GB in fp32, and the loss runs in dozens of chunks a step."""
    from torch.utils._python_dispatch import TorchDispatchMode

    torch.manual_seed(0)
    head = torch.randn(50, 16, dtype=torch.bfloat16)
    hidden = torch.randn(37, 16, requires_grad=True)
    labels, weights = torch.randint(0, 50, (37,)), torch.rand(37)

    class Copies(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.of_head = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            copies = (torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default, torch.ops.aten.clone.default)
            storage = head.untyped_storage().data_ptr()
            if func in copies and any(isinstance(a, torch.Tensor) and a.untyped_storage().data_ptr() == storage for a in args):
                self.of_head.append(func)
            return func(*args, **(kwargs or {}))

    with Copies() as watch:
        loss, _ = FrozenHeadCrossEntropy.apply(hidden, head, labels, weights, weights.sum(), 8)
        loss.backward()
    assert watch.of_head == []
    assert loss.dtype == torch.float32 and hidden.grad.dtype == torch.float32 and torch.isfinite(hidden.grad).all()
    reference = decayed_loss(hidden.detach().bfloat16() @ head.t(), labels, weights)
    assert loss.item() == pytest.approx(reference.item(), rel=1e-2)


def test_a_checkpoint_belongs_to_what_is_trained_not_to_how_it_is_logged():
    from dflash.config import config_hash
    from dflash.run import resumable_settings

    run = {
        "train": {"lr": 1e-3, "log_every": 10, "validate_every": 100, "checkpoint_every": 200},
        "topology": {"nnodes": 2, "collective_timeout_s": 3600},
        "tracking": {"wandb_mode": "offline"},
        "seed": 0,
    }
    observed = {
        "train": {"lr": 1e-3, "log_every": 5, "validate_every": 50, "checkpoint_every": 20},
        "topology": {"nnodes": 2, "collective_timeout_s": 60},
        "tracking": {"wandb_mode": "disabled"},
        "seed": 0,
    }
    assert resumable_settings(run) == {"train": {"lr": 1e-3}, "topology": {"nnodes": 2}, "seed": 0}
    assert config_hash(resumable_settings(run)) == config_hash(resumable_settings(observed))
    assert config_hash(resumable_settings(run)) != config_hash(resumable_settings(run | {"train": {"lr": 2e-3}}))
