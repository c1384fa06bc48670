"""Preflight stage ``env_check``: is this machine able to run the configured workflow?

Checks, each failing with the fix in its message: package versions against
the ranges the project declares, CUDA/NCCL and the device count against the
topology, the compiler torch.compile needs (a C++ compiler on CPU, Triton on
GPU), writable cache and results directories, free disk for checkpoints.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from dflash.acquire import cache_root
from dflash.config import PreflightConfig, TopologyConfig
from dflash.errors import PreflightError
from dflash.preflight.verdict import Verdict

PROJECT = "dflash-workflow"
CHECKED_PACKAGES = ("torch", "transformers", "datasets", "snakemake")
CPU_CONFIG = "config/config.yaml"


@dataclass
class EnvVerdict(Verdict):
    stage: str = "env_check"
    python: str = field(default_factory=platform.python_version)
    versions: dict[str, dict] = field(default_factory=dict)  # name -> installed, supported, ok
    cuda: dict = field(default_factory=dict)
    compiler: dict = field(default_factory=dict)
    directories: dict[str, dict] = field(default_factory=dict)  # role -> path, writable
    free_disk_gb: float = 0.0


def supported_ranges() -> dict[str, str]:
    """The version ranges the project declares: from its installed metadata, else from the pyproject.toml beside the package."""
    try:
        requires = importlib.metadata.requires(PROJECT) or []
        python = importlib.metadata.metadata(PROJECT)["Requires-Python"]
    except importlib.metadata.PackageNotFoundError:
        pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
        try:
            import tomllib
        except ModuleNotFoundError as err:  # Python 3.10
            raise PreflightError(f"{PROJECT} is not installed and Python {platform.python_version()} cannot read {pyproject}: run `pip install -e .`") from err
        if not pyproject.is_file():
            raise PreflightError(f"{PROJECT} is not installed and {pyproject} does not exist: run `pip install -e .` in the project directory") from None
        project = tomllib.loads(pyproject.read_text())["project"]
        requires, python = project["dependencies"], project["requires-python"]
    ranges = {"python": python}
    for line in requires:
        requirement = Requirement(line)
        # Optional extras (e.g. the test extra) are not required to run the workflow.
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
            continue
        if requirement.name in CHECKED_PACKAGES:
            ranges[requirement.name] = str(requirement.specifier)
    return ranges


def check_versions(verdict: EnvVerdict) -> None:
    try:
        ranges = supported_ranges()
    except PreflightError as err:
        verdict.fail(str(err))
        return
    for name, spec in ranges.items():
        if name == "python":
            installed = platform.python_version()
        else:
            try:
                installed = importlib.metadata.version(name)
            except importlib.metadata.PackageNotFoundError:
                installed = None
        ok = installed is not None and SpecifierSet(spec).contains(installed, prereleases=True)
        verdict.versions[name] = {"installed": installed, "supported": spec, "ok": ok}
        if ok:
            continue
        found = "is not installed" if installed is None else f"{installed} is outside the supported range {spec}"
        if name == "python":
            fix = f"create the virtual environment with a Python {spec}"
        elif name == "torch":
            fix = f"install a supported build, e.g. `pip install 'torch{spec}'` (CPU machines: `pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu`)"
        else:
            fix = f"run `pip install '{name}{spec}'`"
        verdict.fail(f"{name} {found}: {fix}")


def check_devices(verdict: EnvVerdict, topology: TopologyConfig) -> None:
    available = torch.cuda.is_available()
    count = torch.cuda.device_count() if available else 0
    distributed = torch.distributed.is_available()
    nccl = distributed and torch.distributed.is_nccl_available()
    verdict.cuda = {
        "built_with": torch.version.cuda,
        "available": available,
        "device_count": count,
        "visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "nccl": nccl,
        "nccl_version": ".".join(map(str, torch.cuda.nccl.version())) if available and nccl else None,
    }
    asked = topology.nproc_per_node
    multi_process = topology.nnodes * asked > 1
    if topology.device == "cuda":
        if count < asked:
            if torch.version.cuda is None:
                why = "this torch is a CPU build"
            elif verdict.cuda["visible_devices"] is not None:
                why = f"CUDA_VISIBLE_DEVICES={verdict.cuda['visible_devices']!r}"
            else:
                why = "no CUDA device is visible"
            fix = f"On a machine without GPUs use the CPU config {CPU_CONFIG} (topology.device: cpu, topology.nproc_per_node: 1)"
            if count:
                fix += f"; here, set topology.nproc_per_node to at most {count}"
            verdict.fail(
                f"topology.device is 'cuda' and topology.nproc_per_node is {asked}: {asked} CUDA device(s) per node asked for, {count} found ({why}). {fix}"
            )
        if multi_process and not nccl:
            verdict.fail(
                f"topology asks for {topology.nnodes * asked} CUDA processes but this torch has no NCCL: install a CUDA build of torch with NCCL, or use one device (topology.nproc_per_node: 1, topology.nnodes: 1)"
            )
    else:
        cores = os.cpu_count() or 1
        if asked > cores:
            verdict.fail(
                f"topology.device is 'cpu' and topology.nproc_per_node is {asked}: {asked} CPU processes asked for, {cores} core(s) found. "
                f"Set topology.nproc_per_node to at most {cores} (the CPU config {CPU_CONFIG} uses 1)"
            )
        if multi_process and not (distributed and torch.distributed.is_gloo_available()):
            verdict.fail(
                "several CPU processes need torch.distributed with the gloo backend, which this torch lacks: set topology.nproc_per_node: 1 and topology.nnodes: 1"
            )


def _probe_cxx(compiler: str) -> str | None:
    """Compile a file that includes Python.h, as inductor's kernels do; the compiler's complaint, or None."""
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "probe.cpp"
        source.write_text("#include <Python.h>\nint probe() { return 0; }\n")
        cmd = [compiler, "-fsyntax-only", f"-I{sysconfig.get_paths()['include']}", str(source)]
        try:
            result = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        except (OSError, subprocess.TimeoutExpired) as err:
            return str(err)
        return None if result.returncode == 0 else (result.stderr.strip() or f"exit status {result.returncode}")[-500:]


def check_compiler(verdict: EnvVerdict, topology: TopologyConfig) -> None:
    """torch.compile turns graphs into C++ on CPU and Triton kernels on GPU; both preflight compile stages and training need it."""
    if topology.device == "cuda":
        from torch.utils._triton import has_triton

        ok = has_triton()
        verdict.compiler = {"kind": "triton", "ok": ok}
        if not ok:
            verdict.fail(
                "Triton is not available, so torch.compile cannot build GPU kernels: install the triton version matching torch (`pip install triton`), or set train.compile: false"
            )
        return
    from torch._inductor.cpp_builder import get_cpp_compiler

    try:
        compiler = get_cpp_compiler()
    except Exception as err:  # inductor raises its own InvalidCxxCompiler
        verdict.compiler = {"kind": "c++", "path": None, "ok": False}
        verdict.fail(f"no C++ compiler found for torch.compile on CPU ({err}): install one (`apt-get install g++`) or point the CXX environment variable at it")
        return
    complaint = _probe_cxx(compiler)
    verdict.compiler = {"kind": "c++", "path": shutil.which(compiler) or compiler, "ok": complaint is None}
    if complaint is not None:
        verdict.fail(
            f"the C++ compiler {compiler} cannot build a file including Python.h as torch.compile does: {complaint}. "
            f"Install the Python headers (`apt-get install python{sys.version_info.major}.{sys.version_info.minor}-dev`) or a working compiler (CXX)"
        )


def _writable(directory: Path) -> str | None:
    """Why ``directory`` cannot take files, or None."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".preflight-"):
            pass
    except OSError as err:
        return str(err)
    return None


def check_directories(verdict: EnvVerdict, results_dir: Path, min_free_gb: float) -> None:
    from torch._inductor.runtime.cache_dir_utils import cache_dir as inductor_cache_dir

    fixes = {
        "results": "run the workflow from a directory you can write to",
        "dflash_cache": "set DFLASH_CACHE_DIR to a writable directory",
        "compile_cache": "set TORCHINDUCTOR_CACHE_DIR to a writable directory",
    }
    for role, directory in (("results", results_dir), ("dflash_cache", cache_root()), ("compile_cache", Path(inductor_cache_dir()))):
        error = _writable(directory)
        verdict.directories[role] = {"path": str(directory.resolve()), "writable": error is None}
        if error is not None:
            verdict.fail(f"{role} directory {directory} is not writable ({error}): {fixes[role]}")
    if results_dir.is_dir():
        verdict.free_disk_gb = round(shutil.disk_usage(results_dir).free / 1e9, 1)
        if verdict.free_disk_gb < min_free_gb:
            verdict.fail(
                f"{verdict.free_disk_gb} GB free under {results_dir}, less than preflight.min_free_disk_gb ({min_free_gb} GB) for checkpoints: "
                "free disk space, or lower preflight.min_free_disk_gb if the run needs less"
            )


def env_check(topology: TopologyConfig, preflight: PreflightConfig, results_dir: str | Path = "results") -> EnvVerdict:
    start = time.perf_counter()
    verdict = EnvVerdict()
    check_versions(verdict)
    check_devices(verdict, topology)
    check_compiler(verdict, topology)
    check_directories(verdict, Path(results_dir), preflight.min_free_disk_gb)
    verdict.seconds = time.perf_counter() - start
    devices = f"{verdict.cuda['device_count']} CUDA device(s)" if topology.device == "cuda" else f"{os.cpu_count()} CPU core(s)"
    verdict.summarize(
        f"python {verdict.python}, torch {torch.__version__}, {devices} for {topology.nnodes}x{topology.nproc_per_node} {topology.device}, "
        f"compiler {verdict.compiler.get('path') or verdict.compiler.get('kind')}, {verdict.free_disk_gb} GB free"
    )
    return verdict
