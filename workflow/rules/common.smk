# Helpers shared by all stages: the validated config, per-stage config sections, the package files each stage runs.
import functools
import json
import sys
from pathlib import Path

from snakemake.exceptions import WorkflowError
from snakemake.settings.types import DeploymentMethod
from snakemake.utils import validate

sys.path.insert(0, workflow.basedir)
from dflash.config import EMBEDDED, HELDOUT, HUMANEVAL, TRANSPORT_KEYS, ConfigError, PromptSource, canonical_json, check_local_sources, hub_copy_name, is_hub_dataset, load_config, to_dict
from dflash.source_imports import function_import_statements, import_statements, imported_modules


# The typed config first: its messages name the dotted key ("train.lrr: unknown key; allowed keys here
# are [...]"), and it parses the strings of nested --config values. The schema then checks the parsed
# values for what the dataclasses do not (e.g. eval set name patterns), and local sources must exist.
try:
    CFG = load_config(config)
    check_local_sources(CFG)
except ConfigError as err:
    raise WorkflowError(f"invalid config: {err}") from None
validate(to_dict(CFG), Path(workflow.basedir) / "workflow" / "schemas" / "config.schema.yaml")

# `snakemake repro_fx_race`, typed without --cores, runs locally on one core like the documented `--cores 1`
# entry points (Snakemake itself refuses a local run without --cores). Set here rather than in a default
# workflow profile, which would override the `cores:` of any --profile. Cluster runs (--jobs) are left alone.
if workflow.resource_settings.cores is None and workflow.resource_settings.nodes is None:
    workflow.resource_settings.cores = 1

RESULTS = "results"
LOGS = f"{RESULTS}/logs"
# Snakemake's benchmark of each job (wall time, peak memory): the report's durations per stage.
BENCHMARKS = f"{RESULTS}/benchmarks"
# The verdict of the preflight checks that take seconds (env_check, then smoke_imports): every expensive stage waits for it.
PREFLIGHT_FAST = f"{RESULTS}/preflight/smoke_imports.json"
ENV = "../../envs/dflash.yaml"
# vLLM's own environment (serve_env): the serve checks run in it, and regeneration where data.generation.engine is
# vllm, or auto (then it may record that vLLM is unavailable, and the local engine regenerates).
VLLM_ENV_MANIFEST = f"{RESULTS}/serve/env.json"
VLLM_REGENERATES = CFG.data.generation.engine in ("auto", "vllm")

# Hub datasets the config names (data.prompts, eval.sets) are fetched once by fetch_dataset, a local rule (under
# SLURM it runs where Snakemake runs, which reaches the network) into results/data/hub; the jobs that read them are
# given that copy as their source (hub_copies), so that compute nodes never call the hub.
HUB_DATASETS = {
    hub_copy_name(p): {"source": p.source, "split": p.split}
    for p in [CFG.data.prompts, *CFG.eval.sets]
    if is_hub_dataset(p.source)
}

# Shell commands run `python -m dflash`: the interpreter running Snakemake, so that a venv works without
# being activated; under --sdm conda the conda environment of the job provides python instead.
if DeploymentMethod.CONDA not in workflow.deployment_settings.deployment_method:
    shell.prefix(f'export PATH="{Path(sys.executable).parent}:$PATH"; ')


def section(*keys, only=None, without=()):
    """Canonical JSON of one config section, defaults filled in and keys sorted: reordering
    YAML keys, or spelling out a default, never reruns a job. ``only`` / ``without`` narrow the
    section to the keys a job reads, so that changing another key does not rerun it."""
    value = CFG
    for key in keys:
        value = getattr(value, key)
    value = to_dict(value)
    names = set(only if only is not None else value) - set(without)
    unknown = names - set(value) or set(without) - set(value)
    if unknown:
        raise WorkflowError(f"section{keys}: no key(s) {sorted(unknown)} in this section")
    return canonical_json({name: value[name] for name in names})


# The topology as what a job computes depends on it: how long ranks wait for each other (collective_timeout_s)
# changes no result, so it reaches the jobs that wait (train, prepare_data) as a resource and reruns nothing.
TOPOLOGY = section("topology", without=["collective_timeout_s"])


def plain(files):
    """Another rule's outputs (``rules.X.output``, or one of them) as plain paths, for an input.

    Snakemake ties an input given as ``rules.X.output`` to X itself, past ``--allowed-rules``. A cluster job's own
    Snakemake runs with ``--allowed-rules`` naming its own rule only, and would then run X as well, inside the job,
    wherever X looks outdated to it, and delete X's outputs when that fails. A plain path reaches X through the
    file, as any input does (tests/test_workflow.py checks that a job runs its own rule only)."""
    return str(files) if isinstance(files, str) else [str(f) for f in files]


def hub_copy(source):
    """The fetched copy of a source dict (``source``, ``split``), if it names a hub dataset."""
    name = hub_copy_name(PromptSource(source=source["source"], split=source["split"]))
    return f"{RESULTS}/data/hub/{name}.parquet" if name in HUB_DATASETS else None


def hub_copies(section_json):
    """A config section (canonical JSON) whose prompt sources (``prompts``, ``sets``) read their fetched copies:
    the files, and the section to pass."""
    value = json.loads(section_json)
    sources = ([value["prompts"]] if "prompts" in value else []) + value.get("sets", [])
    files = []
    for source in sources:
        if (copy := hub_copy(source)) is not None:
            source["source"] = copy
            files.append(copy)
    return files, canonical_json(value)


def data_section(transport):
    """The data section without (``transport=False``) or with only (``True``) the keys of how requests reach servers."""
    data = json.loads(section("data"))
    moved = {key: data["generation"].pop(key) for key in TRANSPORT_KEYS}
    return canonical_json(moved if transport else data)


# The package files a job runs are its inputs: code inside an installed package is otherwise invisible to
# Snakemake. Found from the import statements, so that a new import is never forgotten: the entry points
# (`python -m dflash` and the subcommand table) with their module-level imports; the stage modules, those the
# job's subcommand in cli.py imports, with every import they make, at any depth (stages import lazily inside
# the functions the job runs); and, transitively, the module-level imports of every module imported. A library
# module's lazy imports count only where a stage module imports them (tests/test_workflow.py checks the
# modules each job imported against its inputs).
PACKAGE_ROOT = Path(workflow.basedir)
ENTRY_POINTS = ("__main__", "cli")


def _module_file(name):
    """The file that importing the dotted ``name`` runs, if it is part of the dflash package."""
    if name.split(".")[0] != "dflash":
        return None
    path = PACKAGE_ROOT.joinpath(*name.split("."))
    for candidate in (path.with_suffix(".py"), path / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


@functools.lru_cache(maxsize=None)
def _imports(path, module_level_only=False):
    """The package files the import statements of ``path`` run (with their packages' ``__init__.py``)."""
    files = set()
    for node in import_statements(path, PACKAGE_ROOT, module_level_only):
        for name in imported_modules(node):
            parts = name.split(".")
            files |= {f for i in range(1, len(parts) + 1) if (f := _module_file(".".join(parts[:i]))) is not None}
    return frozenset(files)


def stage(command, *run_by_path):
    """The package files the job ``python -m dflash <command>`` runs. Its stage modules are those the subcommand's
    function in cli.py imports (``run_by_path``: modules a job runs as scripts, in another environment)."""
    root = PACKAGE_ROOT / "dflash"
    cli = root / "cli.py"
    try:
        statements = function_import_statements(cli, PACKAGE_ROOT, command.replace("-", "_"))
    except ValueError as error:
        raise WorkflowError(f"stage({command!r}): {error}") from None
    stage_modules = {f for node in statements for name in imported_modules(node) if (f := _module_file(name)) is not None}
    entry_points = {root / f"{m}.py" for m in ENTRY_POINTS}
    todo = [(path, path in entry_points) for path in entry_points | stage_modules | {root / f"{m}.py" for m in run_by_path}]
    seen = set()
    while todo:
        path, module_level_only = todo.pop()
        if not path.is_file():
            raise WorkflowError(f"stage({command!r}): {path} does not exist")
        if (path, module_level_only) not in seen:
            seen.add((path, module_level_only))
            todo += [(f, True) for f in _imports(path, module_level_only)]
    return sorted({str(path) for path, _ in seen} | {str(root / "__init__.py")})


def local_inputs(source, embedded=None):
    """The local files a config source names (a prompt file, the files of a model directory), as job inputs:
    editing them reruns the job. ``embedded`` is the file the ``embedded`` source reads; hub ids give nothing."""
    if source == EMBEDDED:
        return [embedded] if embedded else []
    path = Path(source).expanduser()
    if path.is_file():
        return [str(path)]
    if path.is_dir():
        return sorted(str(p) for p in path.iterdir() if p.is_file() and not p.name.startswith("."))
    return []


# Every job that touches a GPU declares it. `gpu` is the GPUs the job must see (SLURM: --gpus); gpu_dev0..N
# are the local GPUs it computes on, one resource each, which the local GPU profile (workflow/profiles/local-8gpu)
# allows once, so that two jobs never share a device (without a profile they do not limit anything).
CUDA = CFG.topology.device == "cuda"
NODE_GPUS = CFG.topology.nproc_per_node
LOCAL_GPUS = max(8, NODE_GPUS)


# The devices the compile cache is warmed for (one job warms them all), and the local GPU indices among them.
WARMUP_DEVICES = CFG.preflight.warmup.devices
WARMUP_GPUS = [int(device.removeprefix("cuda")) for device in WARMUP_DEVICES if device != "cpu"]


def gpu_resources(visible, devices):
    """The resources of a job that sees ``visible`` GPUs and computes on the local ``devices`` (indices). Nothing on a
    CPU topology."""
    if not CUDA:
        return {"gpu": 0}
    return {"gpu": visible} | {f"gpu_dev{i}": int(i in devices) for i in range(LOCAL_GPUS)}


def launch_resources(topology):
    """The resources of a job whose processes ``launcher`` starts (train, prepare_data): its nodes, one task per node,
    and on several nodes what the SLURM executor must know of a job that starts its own tasks (``mpi``: the job's
    shell runs the launcher's srun itself, not inside ``srun -n1``; ``tasks_per_gpu: 0``: no ``--ntasks-per-gpu``,
    torchrun starts one process per GPU). These follow from the launcher, so they live here, not in a site's profile,
    whose ``set-resources`` a site replaces whole."""
    several = {"mpi": "srun", "tasks_per_gpu": 0} if topology.nnodes > 1 else {}
    return {"nodes": topology.nnodes, "tasks": topology.nnodes, "launcher": launcher(topology)} | several


def launcher(topology):
    """The command that starts a stage's processes, one per device, for ``python -m dflash train`` or ``prepare-data``.

    A resource, not a param: changing how processes start never retrains. Override it per
    site with a profile (``set-resources: train: launcher: ...``).
    """
    if topology.nnodes * topology.nproc_per_node == 1:
        return "python"
    if topology.nnodes == 1:
        return f"python -m torch.distributed.run --nnodes 1 --nproc-per-node {topology.nproc_per_node} --standalone"
    # Several nodes (SLURM): one torchrun per node, started by srun, meeting at a rendezvous on the job's first node;
    # dflash.launch reads the job from SLURM and checks it against the topology before anything starts.
    return f"python -m dflash.launch --nnodes {topology.nnodes} --nproc-per-node {topology.nproc_per_node}"


# The config's key values the report page shows. Each is read by a stage upstream, so a change reruns that stage anyway;
# keys that rerun nothing (topology.collective_timeout_s, data.generation's transport) stay off the page.
REPORT_KEYS = (
    "seed", "target.source", "target.dtype", "data.prompts.source", "data.prompts.limit", "data.regenerate",
    "data.max_length", "drafter.num_hidden_layers", "drafter.block_size", "drafter.draft_vocab_size", "train.epochs",
    "train.batch_size", "train.lr", "train.gamma", "train.precision", "train.compile", "topology.kind",
    "topology.device", "topology.nnodes", "topology.nproc_per_node", "eval.block_size", "eval.max_new_tokens",
    "eval.gate", "eval.branches", "eval.target_dtype",
)


def report_config_values(keys):
    """The config's values at dotted ``keys`` (defaults filled in), and the evaluation sets' names, as canonical JSON."""
    values = to_dict(CFG)
    picked = {}
    for key in keys:
        value = values
        for part in key.split("."):
            value = value[part]
        picked[key] = value
    picked["eval.sets"] = [s["name"] for s in values["eval"]["sets"]]
    return canonical_json(picked)
