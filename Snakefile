# DFlash drafter training and evaluation. Stages live in workflow/rules; each rule calls the `dflash` package.
#   snakemake --cores 1            everything, report included
#   snakemake --cores 1 train      preflight checks, target, data, training
#   snakemake --cores 1 evaluate   ... and evaluation
#   snakemake --report results/report.html
#   snakemake --cores 1 serve_check   opt-in: the trained drafter in vLLM, against our decoding
#   snakemake --cores 1 llamacpp_build   opt-in: llama.cpp's llama-server built from its pinned source
#   snakemake --cores 1 check_report     opt-in: the report page in headless Chromium


configfile: "config/config.yaml"


include: "workflow/rules/common.smk"
include: "workflow/rules/data.smk"
include: "workflow/rules/preflight.smk"
include: "workflow/rules/train.smk"
include: "workflow/rules/evaluate.smk"
include: "workflow/rules/report.smk"
include: "workflow/rules/serve.smk"


# Under the SLURM executor, why a submitted job waits (a node down, a partition limit) goes into this log, which the
# executor's own status checks never say (dflash/slurm_queue.py).
onstart:
    if getattr(workflow.executor_plugin, "name", None) == "slurm":
        from snakemake.logging import logger

        from dflash.slurm_queue import watch_pending

        watch_pending(Path(workflow.workdir_init), logger.warning)


rule all:
    default_target: True
    input:
        plain(rules.report.output),
