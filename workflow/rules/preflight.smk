# Preflight gates before training: the environment, every import the stages make, the torch.compile
# FX-tracing race on this torch, and a warm compile cache per drafter device.


rule env_check:
    input:
        stage("env-check"),
    output:
        f"{RESULTS}/preflight/env.json",
    resources:
        # It counts the node's GPUs against the topology: it must see them all.
        **gpu_resources(NODE_GPUS, range(NODE_GPUS)),
    params:
        topology=TOPOLOGY,
        preflight=section("preflight", only=["min_free_disk_gb"]),
        # The directory every stage writes under: checked for being writable and for free disk.
        results_dir=lambda wc, output: Path(output[0]).parents[1],
    conda:
        ENV
    log:
        f"{LOGS}/env_check.log",
    benchmark:
        f"{BENCHMARKS}/env_check.tsv",
    shell:
        "python -m dflash env-check --topology {params.topology:q} --preflight {params.preflight:q} "
        "--results-dir {params.results_dir} --out {output} > {log} 2>&1"


rule smoke_imports:
    input:
        stage("smoke-imports"),
        plain(rules.env_check.output),
    output:
        f"{RESULTS}/preflight/smoke_imports.json",
    resources:
        # A tiny drafter's step on each attention backend, on the first device.
        **gpu_resources(1, [0]),
    params:
        topology=TOPOLOGY,
    conda:
        ENV
    log:
        f"{LOGS}/smoke_imports.log",
    benchmark:
        f"{BENCHMARKS}/smoke_imports.tsv",
    shell:
        "python -m dflash smoke-imports --topology {params.topology:q} --out {output} > {log} 2>&1"


# A diagnostic: training runs one process per device, where the race cannot happen, so a failed verdict (written,
# and printed with its problems) does not stop the workflow; `snakemake repro_fx_race` runs it alone.
rule repro_fx_race:
    input:
        stage("repro-fx-race"),
        plain(rules.smoke_imports.output),
    output:
        f"{RESULTS}/preflight/repro_fx_race.json",
    params:
        topology=TOPOLOGY,
        preflight=section("preflight", only=["repro_fx_race"]),
    resources:
        # The race runs on the first device.
        **gpu_resources(1, [0]),
    conda:
        ENV
    log:
        f"{LOGS}/repro_fx_race.log",
    benchmark:
        f"{BENCHMARKS}/repro_fx_race.tsv",
    shell:
        "python -m dflash repro-fx-race --diagnostic --topology {params.topology:q} --preflight {params.preflight:q} --out {output} > {log} 2>&1"


rule warmup_cache:
    input:
        # The warmup process runs the training step (dflash.step), not the training loop (dflash.train).
        stage("warmup-cache"),
        plain(rules.smoke_imports.output),
        manifest=plain(rules.prepare_target.output[0]),
        # The samples decide the batch shapes a run takes, each of which the warmup compiles.
        samples=plain(rules.prepare_data.output.samples),
    output:
        expand(f"{RESULTS}/preflight/warmup/{{device}}.json", device=WARMUP_DEVICES),
    params:
        devices=" ".join(WARMUP_DEVICES),
        drafter=section("drafter"),
        # Not the keys that only the training loop reads: the compiled step does not change with them.
        train=section(
            "train",
            without=[
                "epochs", "warmup_ratio", "lr_schedule", "optimizer", "lr", "weight_decay", "muon_lr", "muon_weight_decay",
                "labels", "loss_normaliser", "position_weights", "dpace_alpha", "checkpoint_every", "log_every",
            ],
        ),
        topology=TOPOLOGY,
        out_dir=lambda wc, output: Path(output[0]).parent,
        # The caches (one per device) outlive the job's declared outputs on purpose: training reads them.
        cache_root=f"{RESULTS}/cache/compile",
    resources:
        # One job warms every device at once; cudaN compiles for cuda:N, so it sees the node's GPUs up to the last.
        **gpu_resources(max(WARMUP_GPUS, default=-1) + 1, WARMUP_GPUS),
    conda:
        ENV
    log:
        f"{LOGS}/warmup_cache.log",
    benchmark:
        f"{BENCHMARKS}/warmup_cache.tsv",
    shell:
        "python -m dflash warmup-cache --devices {params.devices} --drafter {params.drafter:q} --train {params.train:q} --topology {params.topology:q} "
        "--target-manifest {input.manifest} --samples {input.samples} --cache-root {params.cache_root} --out-dir {params.out_dir} > {log} 2>&1"
