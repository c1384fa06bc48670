# Training the drafter, gated by every preflight verdict.


rule train:
    input:
        package("target", "data", "model", "attention", "objective", "train", "tracking"),
        manifest=rules.prepare_target.output[0],
        samples=rules.prepare_data.output.samples,
        preflight=[
            rules.env_check.output[0],
            rules.smoke_imports.output[0],
            rules.repro_fx_race.output[0],
            *expand(rules.warmup_cache.output[0], device=CFG.preflight.warmup.devices),
        ],
    output:
        drafter=directory(f"{RESULTS}/train/drafter"),
        metrics=report(f"{RESULTS}/train/metrics.csv", caption="../report/metrics.rst", category="Training"),
        summary=f"{RESULTS}/train/summary.json",
    params:
        drafter=section("drafter"),
        train=section("train"),
        topology=section("topology"),
        tracking=section("tracking"),
        seed=CFG.seed,
        out_dir=lambda wc, output: Path(output.summary).parent,
        # Resumable checkpoints and the hidden-state cache live outside the declared
        # outputs, which Snakemake deletes before rerunning a job.
        checkpoint_dir=f"{RESULTS}/cache/train",
    conda:
        ENV
    log:
        f"{LOGS}/train.log",
    shell:
        "python -m dflash train --drafter {params.drafter:q} --train {params.train:q} "
        "--topology {params.topology:q} --tracking {params.tracking:q} --seed {params.seed} "
        "--target-manifest {input.manifest} --samples {input.samples} --preflight {input.preflight} "
        "--out-dir {params.out_dir} --checkpoint-dir {params.checkpoint_dir} > {log} 2>&1"
