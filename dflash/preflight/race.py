"""Preflight stage ``repro_fx_race``: the torch.compile FX-tracing race, reproduced on the installed torch, and the mitigation verified.

Three experiments on one device (see ``dflash.preflight.fx_race`` for the mechanism):

(a) deterministic: thread A holds an FX trace open (a ``make_fx`` of a
    function that waits on an event) while thread B calls the compiled
    drafter attention; records whether B raises and which frames set the flag,
    then repeats B's call with the mitigation.
(b) natural: N threads each train the drafter's attention layer
    (``dflash.model.Attention``, tiny, compiled), forward and backward, on
    their own sequence length (as data-parallel ranks do), in K trials that
    each compile cold (see ``cold_compile_caches``). Counts the trials that raise.
(c) the same with the mitigation inside every worker thread: must give zero.

Each trial also records whether the flag was left stuck and whether any
compiled call silently ran eagerly. The verdict says for which executions
training is safe (``safe_for``). Training runs one process per device, where the race cannot
happen: ``train`` logs the verdict as a diagnostic.
"""

from __future__ import annotations

import os
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx

from dflash.attention import TrainingMask, build_training_mask, resolve_backend
from dflash.config import RaceConfig, TopologyConfig
from dflash.model import Attention, DFlashConfig, RotaryEmbedding
from dflash.preflight.fx_race import (
    MITIGATION,
    clear_fx_tracing_flag,
    frames_holding_trace,
    fx_race_mitigation,
    fx_tracing_flag,
    is_fx_race_error,
    shared_fx_tracing_flag,
)
from dflash.preflight.gate import PROCESSES, THREADS, first_device
from dflash.preflight.synthetic import TINY_SHAPE
from dflash.preflight.verdict import Verdict

TIMEOUT_S = 300.0  # a hung trial is a failure, not a stuck workflow
# Threads driving GPUs release the GIL at every kernel launch and interleave
# finely; Python's default 5 ms switch interval would let a CPU thread run its
# whole step while another sits in a short backward trace, and hide the race.
# A 10 us interval gives CPU threads the GPU threads' interleaving.
SWITCH_INTERVAL_S = 1e-5


@dataclass
class Deterministic:
    reproduced: bool = False  # the compiled call raised while another thread held an FX trace open
    error: str | None = None
    flag_set_by: list[str] = field(default_factory=list)  # the tracing thread's frames, from the one that set the flag outwards
    mitigated_raised: bool = False  # the same call, with the mitigation in the calling thread
    flag_stuck: bool = False  # the flag still set after the trace ended


@dataclass
class Trials:
    trials: int = 0
    threads: int = 0
    steps: int = 0  # each thread's minimum; it keeps training while another thread still compiles
    switch_interval_s: float = SWITCH_INTERVAL_S  # the GIL switch interval the trials ran under
    errors: int = 0  # trials in which a thread raised the race error
    thread_errors: int = 0  # threads that raised it, over all trials
    flag_stuck: int = 0  # trials after which the flag stayed set
    eager_calls: int = 0  # compiled calls that ran eagerly instead
    other_errors: list[str] = field(default_factory=list)
    flag_set_by: list[str] = field(default_factory=list)  # frames of a thread inside an FX trace at the first error
    seconds: float = 0.0


@dataclass
class RaceVerdict(Verdict):
    stage: str = "repro_fx_race"
    device: str = "cpu"
    mitigation: str = MITIGATION
    shared_flag: bool = True  # this torch keeps the FX flag process-wide: threads can race
    deterministic: Deterministic = field(default_factory=Deterministic)
    natural: Trials = field(default_factory=Trials)
    mitigated: Trials = field(default_factory=Trials)
    mitigation_verified: bool = False  # the deterministic call and every mitigated trial ran clean
    safe_for: list[str] = field(default_factory=list)  # PROCESSES always; THREADS when the mitigation is verified or the flag is per thread


# -- the compiled thing: the drafter's attention layer -----------------------------------------------

# The drafter's attention at tiny shapes: a cold compile of its forward and backward takes seconds.
TINY = DFlashConfig(**TINY_SHAPE, num_hidden_layers=1, num_target_layers=4, target_layer_ids=[1], mask_token_id=127, block_size=4)
ANCHORS = 3


def _probed(layer: Attention, counter: Counter) -> Callable:
    """The layer, counting the calls that run eagerly: under Dynamo the branch is constant False and leaves no trace in the graph."""

    def attention_layer(block, context, block_rope, context_rope, mask):
        if not torch.compiler.is_compiling():
            counter["eager"] += 1
        return layer(block, context, block_rope, context_rope, mask, None, 0)

    return attention_layer


class RaceBlock(nn.Module):
    """``dflash.model.Attention`` compiled, the rest (rotary tables, loss) eager, as the drafter's layers run in training.

    Static shapes, as in the note's measurements: each new shape then compiles
    its backward lazily, at the first ``backward()``, outside the forward's
    compile session, which is where the flag escapes to other threads. Its
    backward makes inductor rewrite the summed weight gradients of the
    projections shared by context and block, through ``make_fx``.
    """

    def __init__(self, eager_calls: Counter):
        super().__init__()
        self.attention = Attention(TINY)
        self.rotary = RotaryEmbedding(TINY.head_dim, TINY.rope_theta)
        self.compiled = torch.compile(_probed(self.attention, eager_calls), dynamic=False)

    def forward(self, context: torch.Tensor, block: torch.Tensor, mask: TrainingMask) -> torch.Tensor:
        batch, context_length, _ = context.shape
        positions = torch.arange(context_length + block.shape[1], device=context.device).expand(batch, -1)
        context_rope = self.rotary(positions[:, :context_length], context.dtype)
        block_rope = self.rotary(positions[:, context_length:], block.dtype)
        return self.compiled(block, context, block_rope, context_rope, mask)


def _inputs(context_length: int, device: torch.device, seed: int) -> tuple[torch.Tensor, torch.Tensor, TrainingMask]:
    """Context, block and training mask of a two-row batch with ``context_length`` context tokens."""
    generator = torch.Generator().manual_seed(seed)
    anchors = torch.randperm(context_length - 1, generator=generator)[: 2 * ANCHORS].view(2, ANCHORS).sort(dim=1).values
    valid = torch.ones(2, ANCHORS, dtype=torch.bool)
    mask = build_training_mask(anchors.to(device), valid.to(device), context_length, TINY.block_size, resolve_backend("auto", device))
    context = torch.randn(2, context_length, TINY.hidden_size, generator=generator).to(device)
    block = torch.randn(2, ANCHORS * TINY.block_size, TINY.hidden_size, generator=generator).to(device)
    return context, block, mask


# -- (a) deterministic ----------------------------------------------------------------------------


def _call_during_trace(fn: Callable[[], object], mitigate: bool) -> tuple[str | None, list[str], bool]:
    """Call ``fn`` from a fresh thread while another thread sits inside ``make_fx``.

    Returns the race error raised (or None), the tracing thread's frames that
    set the flag, and whether the flag stayed set after the trace ended.
    """
    entered, release = threading.Event(), threading.Event()

    def held_open(x):
        entered.set()
        release.wait(TIMEOUT_S)
        return x + 1

    tracer = threading.Thread(target=lambda: make_fx(held_open)(torch.zeros(1)), name="fx-trace-holder", daemon=True)
    tracer.start()
    if not entered.wait(TIMEOUT_S):
        raise RuntimeError(f"make_fx did not start within {TIMEOUT_S:.0f} s")
    flag_set_by = frames_holding_trace(tracer.ident)
    outcome: dict = {}

    def call():
        try:
            with race_compile_settings(mitigate):
                fn()
        except Exception as err:
            outcome["error"] = err

    caller = threading.Thread(target=call, name="compiled-caller")
    caller.start()
    caller.join(TIMEOUT_S)
    release.set()
    tracer.join(TIMEOUT_S)
    stuck = fx_tracing_flag()
    clear_fx_tracing_flag()
    error = outcome.get("error")
    if error is not None and not is_fx_race_error(error):
        raise error
    return (str(error) if error else None), flag_set_by, stuck


def reproduce_deterministic(device: torch.device) -> Deterministic:
    block = RaceBlock(Counter()).to(device)
    inputs = _inputs(29, device, seed=0)
    with race_compile_settings(mitigate=False):
        block(*inputs)  # compile here, alone: the call under test finds the compiled code
    error, flag_set_by, stuck = _call_during_trace(lambda: block(*inputs), mitigate=False)
    mitigated_error, _, mitigated_stuck = _call_during_trace(lambda: block(*inputs), mitigate=True)
    return Deterministic(
        reproduced=error is not None,
        error=error,
        flag_set_by=flag_set_by,
        mitigated_raised=mitigated_error is not None,
        flag_stuck=stuck or mitigated_stuck,
    )


# -- (b, c) natural ---------------------------------------------------------------------------------


@contextmanager
def cold_compile_caches(directory: Path) -> Iterator[None]:
    """Compiles inside start cold: Dynamo's cache reset, inductor's FX-graph and AOT-autograd caches in an empty directory.

    Compiled C++ kernels stay loaded in memory, reused by their source hash:
    compiling them never sets the flag, and rebuilding them would make each
    trial several times slower without changing the race.
    """
    previous = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(directory)
    torch._dynamo.reset()
    try:
        yield
    finally:
        torch._dynamo.reset()
        if previous is None:
            del os.environ["TORCHINDUCTOR_CACHE_DIR"]
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = previous


@contextmanager
def fine_thread_interleaving() -> Iterator[None]:
    previous = sys.getswitchinterval()
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    try:
        yield
    finally:
        sys.setswitchinterval(previous)


@contextmanager
def race_compile_settings(mitigate: bool) -> Iterator[None]:
    """Compile settings of one thread: each thread enters this itself, since Dynamo's and inductor's configs are per
    thread from torch 2.12 on (on 2.11 they are the process's, which is harmless here: a trial's threads all mitigate
    or none does, and trials run one after the other).

    Scalar CPU kernels: the race is in tracing, not in the generated code, and
    vectorised CPU code generation doubles the cost of a cold compile.
    """
    with (
        fx_race_mitigation() if mitigate else nullcontext(),
        torch._inductor.config.patch({"cpp.simdlen": 1}),
        # One graph per thread's shape; past the limit Dynamo would quietly run the layer eagerly.
        torch._dynamo.config.patch(recompile_limit=64),
    ):
        yield


@dataclass
class _Trial:
    """What the threads of one trial share."""

    threads: int
    start: threading.Barrier
    stop: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)
    warm: int = 0  # threads past their first step (compiled forward and backward)
    race_errors: int = 0
    other_errors: list[str] = field(default_factory=list)
    flag_set_by: list[str] = field(default_factory=list)


def _train_thread(index: int, trial: _Trial, steps: int, mitigate: bool, device: torch.device, eager: Counter) -> None:
    """Train until this thread has done ``steps`` steps and every thread has compiled, as threads of a long run would."""
    try:
        with race_compile_settings(mitigate):
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(index)
                block = RaceBlock(eager).to(device)
            optimizer = torch.optim.SGD(block.parameters(), lr=1e-3)
            # Each thread its own sequence length, as ranks get different batches: each compiles its own graphs.
            inputs = _inputs(29 + 8 * index, device, seed=index)
            trial.start.wait(TIMEOUT_S)
            deadline = time.monotonic() + TIMEOUT_S
            done = 0
            while not trial.stop.is_set() and (done < steps or trial.warm < trial.threads):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"thread {index} still waiting for the other threads to compile after {TIMEOUT_S:.0f} s")
                block(*inputs).float().pow(2).mean().backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                done += 1
                if done == 1:
                    with trial.lock:
                        trial.warm += 1
    except Exception as err:
        racing = is_fx_race_error(err)
        # The thread that set the flag is still inside its trace: its frames say who it was.
        holders = [line for t in threading.enumerate() if racing and t is not threading.current_thread() for line in frames_holding_trace(t.ident)]
        with trial.lock:
            if racing:
                trial.race_errors += 1
                trial.flag_set_by = trial.flag_set_by or holders
            else:
                trial.other_errors.append(f"thread {index}: {type(err).__name__}: {err}")
        trial.stop.set()
        trial.start.abort()  # a thread that failed before the start must not keep the others waiting


def run_trials(device: torch.device, race: RaceConfig, mitigate: bool, cache_root: Path) -> Trials:
    start = time.perf_counter()
    result = Trials(trials=race.trials, threads=race.threads, steps=race.steps)
    eager: Counter = Counter()
    for k in range(race.trials):
        trial = _Trial(threads=race.threads, start=threading.Barrier(race.threads))
        with cold_compile_caches(cache_root / f"{'mitigated' if mitigate else 'natural'}-{k}"), fine_thread_interleaving():
            workers = [
                threading.Thread(target=_train_thread, args=(i, trial, race.steps, mitigate, device, eager), name=f"race-worker-{i}")
                for i in range(race.threads)
            ]
            for worker in workers:
                worker.start()
            for worker in workers:
                worker.join()
        if fx_tracing_flag():
            result.flag_stuck += 1
            clear_fx_tracing_flag()  # so that the next trial starts clean
        result.errors += trial.race_errors > 0
        result.thread_errors += trial.race_errors
        result.other_errors += trial.other_errors
        result.flag_set_by = result.flag_set_by or trial.flag_set_by
    result.eager_calls = eager["eager"]
    result.seconds = time.perf_counter() - start
    return result


# -- the verdict ------------------------------------------------------------------------------------


def repro_fx_race(topology: TopologyConfig, race: RaceConfig) -> RaceVerdict:
    start = time.perf_counter()
    device = first_device(topology)
    verdict = RaceVerdict(device=str(device), shared_flag=shared_fx_tracing_flag())
    with tempfile.TemporaryDirectory(prefix="dflash-race-") as tmp:
        with cold_compile_caches(Path(tmp) / "deterministic"):
            verdict.deterministic = reproduce_deterministic(device)
        verdict.natural = run_trials(device, race, mitigate=False, cache_root=Path(tmp))
        verdict.mitigated = run_trials(device, race, mitigate=True, cache_root=Path(tmp))
    judge(verdict)
    verdict.seconds = time.perf_counter() - start
    d, n, m = verdict.deterministic, verdict.natural, verdict.mitigated
    verdict.summarize(
        f"torch {torch.__version__} on {device}: deterministic race {'reproduced' if d.reproduced else 'not reproduced'}, "
        f"natural {n.errors}/{n.trials} trials raised ({n.threads} threads), with {MITIGATION} {m.errors}/{m.trials}"
        f"{'' if verdict.mitigation_verified else ' (mitigation NOT verified)'}; safe for {', '.join(verdict.safe_for)}"
    )
    return verdict


def judge(verdict: RaceVerdict) -> None:
    """The stage fails only when the reproduction itself is broken; a mitigation that does not hold
    only narrows ``safe_for`` to one process per device."""
    for label, trials in (("natural", verdict.natural), ("mitigated", verdict.mitigated)):
        if trials.other_errors:
            verdict.fail(
                f"the {label} race trials failed for another reason than the race: {trials.other_errors[0]}; run `dflash repro-fx-race` alone to see it, and fix that first"
            )
    if verdict.shared_flag and not verdict.deterministic.reproduced:
        verdict.fail(
            f"the deterministic reproduction did not raise, although torch {verdict.torch_version} keeps the FX tracing flag process-wide: "
            "the reproduction is broken (a compiled call made while another thread traces must raise); fix dflash.preflight.race before trusting its verdict"
        )
    mitigated = verdict.mitigated
    verdict.mitigation_verified = not (
        verdict.deterministic.mitigated_raised or mitigated.errors or mitigated.flag_stuck or mitigated.eager_calls or mitigated.other_errors
    )
    verdict.safe_for = [PROCESSES] + ([THREADS] if verdict.mitigation_verified or not verdict.shared_flag else [])
