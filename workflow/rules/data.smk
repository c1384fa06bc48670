# The target model and the training data it regenerates.


rule prepare_target:
    output:
        f"{RESULTS}/target/target.json",
    params:
        target=section("target"),
    input:
        package("target"),
        # A local model directory: its weights, config and tokenizer.
        local_inputs(CFG.target.source),
    conda:
        ENV
    log:
        f"{LOGS}/prepare_target.log",
    shell:
        "python -m dflash prepare-target --target {params.target:q} --out {output} > {log} 2>&1"


rule prepare_data:
    input:
        package("target", "data", "generation"),
        local_inputs(CFG.data.prompts.source, embedded=f"{workflow.basedir}/dflash/assets/chat_prompts.jsonl"),
        manifest=rules.prepare_target.output[0],
    output:
        samples=f"{RESULTS}/data/train.parquet",
        validation=f"{RESULTS}/data/validation.parquet",
        heldout=f"{RESULTS}/data/heldout.jsonl",
        card=f"{RESULTS}/data/card.json",
    params:
        data=section("data"),
        seed=CFG.seed,
        out_dir=lambda wc, output: Path(output.samples).parent,
        # Complete chunks of regenerated responses, outside the declared outputs (which Snakemake deletes on
        # failure): a rerun regenerates only what no complete chunk holds.
        chunk_dir=f"{RESULTS}/cache/data",
    resources:
        # One process per device of the topology regenerates its chunks: resources, not params, so that
        # the same data on another topology is not regenerated (it would be identical).
        **gpu_resources(CFG.topology.nnodes * NODE_GPUS, range(NODE_GPUS)),
        nodes=CFG.topology.nnodes,
        tasks=CFG.topology.nnodes,
        launcher=launcher(CFG.topology),
        topology=section("topology", only=["device"]),
    conda:
        ENV
    log:
        f"{LOGS}/prepare_data.log",
    shell:
        "{resources.launcher} -m dflash prepare-data --data {params.data:q} --topology {resources.topology:q} --seed {params.seed} "
        "--target-manifest {input.manifest} --out-dir {params.out_dir} --chunk-dir {params.chunk_dir} > {log} 2>&1"
