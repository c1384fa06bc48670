# Training the drafter, gated by every preflight verdict: one process per device, started by torchrun.


rule train:
    input:
        stage("train"),
        manifest=rules.prepare_target.output[0],
        samples=rules.prepare_data.output.samples,
        validation=rules.prepare_data.output.validation,
        preflight=[
            rules.env_check.output[0],
            rules.smoke_imports.output[0],
            rules.repro_fx_race.output[0],
            # A warm compile cache only matters to a compiled drafter.
            *(rules.warmup_cache.output if CFG.train.compile else []),
        ],
    output:
        drafter=directory(f"{RESULTS}/train/drafter"),
        metrics=report(f"{RESULTS}/train/metrics.csv", caption="../report/metrics.rst", category="Training"),
        summary=f"{RESULTS}/train/summary.json",
    params:
        drafter=section("drafter"),
        train=section("train"),
        topology=section("topology"),
        seed=CFG.seed,
        out_dir=lambda wc, output: Path(output.summary).parent,
        # Resumable checkpoints and the hidden-state cache live outside the declared
        # outputs, which Snakemake deletes before rerunning a job.
        checkpoint_dir=f"{RESULTS}/cache/train",
    resources:
        # All GPUs of the job (SLURM: --gpus, with --nodes); locally, one gpu_dev<i> per device it runs on.
        **gpu_resources(CFG.topology.nnodes * NODE_GPUS, range(NODE_GPUS)),
        nodes=CFG.topology.nnodes,
        tasks=CFG.topology.nnodes,
        launcher=launcher(CFG.topology),
        # Where the run is logged, not what it computes: a resource, so changing it never retrains.
        tracking=section("tracking"),
    conda:
        ENV
    log:
        f"{LOGS}/train.log",
    shell:
        "{resources.launcher} -m dflash train --drafter {params.drafter:q} --train {params.train:q} "
        "--topology {params.topology:q} --tracking {resources.tracking:q} --seed {params.seed} "
        "--target-manifest {input.manifest} --samples {input.samples} --validation {input.validation} --preflight {input.preflight} "
        "--out-dir {params.out_dir} --checkpoint-dir {params.checkpoint_dir} > {log} 2>&1"
