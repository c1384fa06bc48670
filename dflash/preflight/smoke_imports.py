"""Preflight stage ``smoke_imports``: every import the stages make, then a tiny drafter on each attention backend.

The import lines are the package's own, read from its source (``import_lines``),
so the check never drifts from the code: a name that moved, or a module that
is missing, fails here in seconds with the line, the module it was looked for
in, and where the name lives now, instead of minutes into a stage.

Then a tiny drafter runs one forward and one training step per attention
backend available on the device: SDPA trains everywhere, flex trains on CUDA
and runs forward only on the CPU (flex_attention has no CPU backward in torch
2.13). Both backends must give the same loss on the same batch.
"""

from __future__ import annotations

import ast
import copy
import importlib
import time
import traceback
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dflash.preflight.verdict import Verdict
from dflash.source_imports import import_statements

PACKAGE_DIR = Path(__file__).resolve().parents[1]
# Modules run by their path in an environment of their own, whose imports are checked there: vLLM's (serve_env).
OWN_ENVIRONMENT = ("vllm_runner.py",)


@dataclass
class SmokeVerdict(Verdict):
    stage: str = "smoke_imports"
    device: str = "cpu"
    imports: int = 0  # import lines checked
    failed_imports: list[dict] = field(default_factory=list)  # line, used_in, error
    backends: dict[str, dict] = field(default_factory=dict)  # backend -> forward_loss, trained, note


def import_lines(package_dir: Path = PACKAGE_DIR) -> dict[str, list[str]]:
    """Each distinct import line written in the package (optional ones aside), mapped to where it is written
    (``dflash/train.py:25``)."""
    lines: dict[str, list[str]] = {}
    for path in sorted(p for p in package_dir.rglob("*.py") if p.name not in OWN_ENVIRONMENT):
        relative = path.relative_to(package_dir.parent)
        for node in import_statements(path, package_dir.parent, optional=False):
            lines.setdefault(ast.unparse(node), []).append(f"{relative}:{node.lineno}")
    return lines


def _package_modules() -> list[str]:
    """The package's module names, except ``__main__``, which runs the command line when imported."""
    names = {".".join(p.relative_to(PACKAGE_DIR.parent).with_suffix("").parts) for p in PACKAGE_DIR.rglob("*.py")}
    return sorted(n.removesuffix(".__init__") for n in names if not n.endswith("__main__"))


def _defined_in(name: str) -> list[str]:
    """Package modules that define ``name`` (not merely import it): where a misplaced import should look."""
    homes = []
    for module_name in _package_modules():
        try:
            module = importlib.import_module(module_name)
        except Exception:  # a broken module is reported by its own import line
            continue
        value = getattr(module, name, None)
        if value is not None and getattr(value, "__module__", module_name) == module_name:
            homes.append(module_name)
    return homes


def _import_error(err: BaseException) -> str:
    """The error and the innermost package frame it came from (a broken import inside an imported module)."""
    frames = [f for f in traceback.extract_tb(err.__traceback__) if "dflash" in Path(f.filename).parts and f.filename != __file__]
    where = f" (at {Path(frames[-1].filename).name}:{frames[-1].lineno})" if frames else ""
    return f"{type(err).__name__}: {err}{where}"


def check_import(line: str) -> str | None:
    """Run one import line; None when it works, else what is missing and where it was looked for."""
    node = ast.parse(line).body[0]
    if isinstance(node, ast.Import):
        for alias in node.names:
            try:
                importlib.import_module(alias.name)
            except Exception as err:
                return f"module {alias.name!r} cannot be imported: {_import_error(err)}"
        return None
    module_name = node.module
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name == module_name:
            homes = {alias.name: _defined_in(alias.name) for alias in node.names}
            hints = [f"{name} is defined in {', '.join(modules)}" for name, modules in homes.items() if modules]
            return f"module {module_name!r} does not exist" + (f"; {'; '.join(hints)}" if hints else "")
        return f"module {module_name!r} cannot be imported: {_import_error(err)}"
    except Exception as err:
        return f"module {module_name!r} cannot be imported: {_import_error(err)}"
    for alias in node.names:
        if alias.name == "*" or hasattr(module, alias.name):
            continue
        try:  # a submodule not yet imported is also importable by name
            importlib.import_module(f"{module_name}.{alias.name}")
            continue
        except ModuleNotFoundError:
            pass
        elsewhere = [m for m in _defined_in(alias.name) if m != module_name]
        hint = f"; it is defined in {', '.join(elsewhere)}" if elsewhere else ""
        return f"name {alias.name!r} is not in module {module_name!r} ({getattr(module, '__file__', '?')}){hint}"
    return None


def check_imports(verdict: SmokeVerdict, lines: dict[str, list[str]]) -> None:
    for line, used_in in lines.items():
        error = check_import(line)
        verdict.imports += 1
        if error is not None:
            verdict.failed_imports.append({"line": line, "used_in": used_in, "error": error})
            written = f" (written in {', '.join(used_in)})" if used_in else ""
            verdict.fail(f"`{line}`{written} fails: {error}. Fix the import line, or restore the name where it is imported from")


def check_backends(verdict: SmokeVerdict, device: torch.device) -> None:
    """One forward per backend on the same batch and weights, one training step where the backend has a backward."""
    from dflash.config import TrainConfig
    from dflash.model import DFlashDrafter
    from dflash.preflight.synthetic import synthetic_batch, tiny_drafter_config, tiny_target
    from dflash.step import drafter_loss

    target = tiny_target(device)
    config = tiny_drafter_config(target)
    batch = synthetic_batch(config, lengths=[37, 29], cfg=TrainConfig(max_anchors=3))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        drafter = DFlashDrafter(config).to(device)
    trains = {"sdpa": True, "flex": device.type == "cuda"}
    for backend, can_train in trains.items():
        result: dict = {}
        verdict.backends[backend] = result
        try:
            with torch.no_grad(), warnings.catch_warnings():
                # Uncompiled flex_attention warns that it is slow; the batch is tiny.
                warnings.filterwarnings("ignore", category=UserWarning, module=r"torch\.nn\.attention")
                loss = drafter_loss(drafter, target, batch, backend, head_chunk=64)[0]
            result["forward_loss"] = float(loss)
            if not torch.isfinite(loss):
                verdict.fail(
                    f"the {backend} attention backend gives a non-finite loss ({float(loss)}) on a tiny drafter: the attention mask or kernel is broken"
                )
                continue
            if not can_train:
                result["trained"] = False
                result["note"] = f"forward only: flex_attention has no backward on {device.type} in torch {torch.__version__.split('+')[0]}"
                continue
            model = copy.deepcopy(drafter)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            before = [p.detach().clone() for p in model.parameters()]
            drafter_loss(model, target, batch, backend, head_chunk=64)[0].backward()
            grads_finite = all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
            optimizer.step()
            moved = any(not torch.equal(a, p.detach()) for a, p in zip(before, model.parameters(), strict=True))
            result["trained"] = grads_finite and moved
            if not result["trained"]:
                verdict.fail(
                    f"a training step with the {backend} attention backend left {'non-finite or missing gradients' if not grads_finite else 'the weights unchanged'}: the backward is broken"
                )
        except Exception as err:
            result["error"] = f"{type(err).__name__}: {err}"
            verdict.fail(f"the {backend} attention backend fails on a tiny drafter on {device}: {type(err).__name__}: {err}")
    losses = {b: r["forward_loss"] for b, r in verdict.backends.items() if "forward_loss" in r}
    if len(losses) == 2 and abs(losses["sdpa"] - losses["flex"]) > 1e-3 * max(1.0, abs(losses["sdpa"])):
        verdict.fail(
            f"the sdpa and flex attention backends disagree on the same batch (loss {losses['sdpa']:.6f} vs {losses['flex']:.6f}): the two mask paths in dflash.attention differ"
        )


def smoke_imports(device: str = "cpu", lines: Sequence[str] | dict[str, list[str]] | None = None) -> SmokeVerdict:
    """``lines`` defaults to the package's own import lines; the backends are tried only when every import works."""
    start = time.perf_counter()
    verdict = SmokeVerdict(device=str(device))
    if lines is None:
        lines = import_lines()
    elif not isinstance(lines, dict):
        lines = {line: [] for line in lines}
    check_imports(verdict, lines)
    if verdict.ok:
        check_backends(verdict, torch.device(device))
    verdict.seconds = time.perf_counter() - start
    backends = ", ".join(f"{b} {'train' if r.get('trained') else 'forward' if 'forward_loss' in r else 'failed'}" for b, r in verdict.backends.items())
    verdict.summarize(f"{verdict.imports - len(verdict.failed_imports)}/{verdict.imports} import lines work; {backends or 'backends not tried'} on {device}")
    return verdict
