# Helpers shared by all stages: the validated config, per-stage config sections, the package files each stage runs.
import sys
from pathlib import Path

from snakemake.settings.types import DeploymentMethod
from snakemake.utils import validate

sys.path.insert(0, workflow.basedir)
from dflash.config import ConfigError, canonical_json, load_config


validate(config, Path(workflow.basedir) / "workflow" / "schemas" / "config.schema.yaml")
try:
    CFG = load_config(config)
except ConfigError as err:
    raise ValueError(f"config error: {err}") from None

RESULTS = "results"
LOGS = f"{RESULTS}/logs"
ENV = "../../envs/dflash.yaml"

# Shell commands run `python -m dflash`: the interpreter running Snakemake, so that a venv works without
# being activated; under --sdm conda the conda environment of the job provides python instead.
if DeploymentMethod.CONDA not in workflow.deployment_settings.deployment_method:
    shell.prefix(f'export PATH="{Path(sys.executable).parent}:$PATH"; ')


def section(*keys):
    """Canonical JSON of one config section, defaults filled in and keys sorted: reordering
    YAML keys, or spelling out a default, never reruns a job."""
    value = CFG
    for key in keys:
        value = getattr(value, key)
    return canonical_json(value)


def package(*modules):
    """The package files a job runs: code inside an installed package is otherwise invisible to Snakemake."""
    return [f"{workflow.basedir}/dflash/{m}.py" for m in ("__init__", "cli", "config") + modules]
