# Training the drafter, gated by every preflight verdict: one process per device, started by torchrun.


rule train:
    input:
        stage("train"),
        manifest=plain(rules.prepare_target.output[0]),
        samples=plain(rules.prepare_data.output.samples),
        validation=plain(rules.prepare_data.output.validation),
        preflight=[
            plain(rules.env_check.output[0]),
            plain(rules.smoke_imports.output[0]),
            plain(rules.repro_fx_race.output[0]),
            # A warm compile cache only matters to a compiled drafter.
            *(plain(rules.warmup_cache.output) if CFG.train.compile else []),
        ],
    output:
        drafter=directory(f"{RESULTS}/train/drafter"),
        metrics=report(f"{RESULTS}/train/metrics.csv", caption="../report/metrics.rst", category="Training"),
        summary=f"{RESULTS}/train/summary.json",
    params:
        drafter=section("drafter"),
        train=section("train"),
        topology=TOPOLOGY,  # what invalidates; the job reads resources.topology
        seed=CFG.seed,
        out_dir=lambda wc, output: Path(output.summary).parent,
        # Resumable checkpoints and the hidden-state cache live outside the declared
        # outputs, which Snakemake deletes before rerunning a job.
        checkpoint_dir=f"{RESULTS}/cache/train",
    resources:
        # All GPUs of the job (SLURM: --gpus, with --nodes); locally, one gpu_dev<i> per device it runs on.
        **gpu_resources(CFG.topology.nnodes * NODE_GPUS, range(NODE_GPUS)),
        **launch_resources(CFG.topology),
        # Where the run is logged, not what it computes: a resource, so changing it never retrains.
        tracking=section("tracking"),
        topology=section("topology"),  # TOPOLOGY and how long ranks wait for each other
    conda:
        ENV
    log:
        f"{LOGS}/train.log",
    benchmark:
        f"{BENCHMARKS}/train.tsv",
    shell:
        "{resources.launcher} -m dflash train --drafter {params.drafter:q} --train {params.train:q} "
        "--topology {resources.topology:q} --tracking {resources.tracking:q} --seed {params.seed} "
        "--target-manifest {input.manifest} --samples {input.samples} --validation {input.validation} --preflight {input.preflight} "
        "--out-dir {params.out_dir} --checkpoint-dir {params.checkpoint_dir} > {log} 2>&1"
