# Helpers shared by every rule: the validated config, per-rule config sections, the package files a rule runs.
import sys
from pathlib import Path

from snakemake.utils import validate

sys.path.insert(0, workflow.basedir)
from dflash.config import ConfigError, canonical_json, load_config


validate(config, Path(workflow.basedir) / "workflow" / "schemas" / "config.schema.yaml")
try:
    CFG = load_config(config)
except ConfigError as err:
    raise ValueError(f"config error: {err}") from None

# The interpreter running Snakemake: shell commands then work from a venv that was never activated.
PY = sys.executable
RESULTS = "results"
LOGS = f"{RESULTS}/logs"


def section(*keys):
    """Canonical JSON of one config section, defaults filled in and keys sorted: reordering
    YAML keys, or spelling out a default, never reruns a job."""
    value = CFG
    for key in keys:
        value = getattr(value, key)
    return canonical_json(value)


def package(*modules):
    """The package files a rule runs: code inside an installed package is otherwise invisible to Snakemake."""
    return [f"dflash/{m}.py" for m in ("__init__", "cli", "config") + modules]
