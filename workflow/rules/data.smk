# The target model and the training data it regenerates.


rule prepare_target:
    output:
        f"{RESULTS}/target/target.json",
    params:
        target=section("target"),
    input:
        stage("prepare-target"),
        # A local model directory: its weights, config and tokenizer.
        local_inputs(CFG.target.source),
        # The checks that take seconds run before the stages that take hours; ancient: a rewritten verdict alone
        # (the preflight's code changed, say) reruns nothing here.
        ancient(PREFLIGHT_FAST),
    conda:
        ENV
    log:
        f"{LOGS}/prepare_target.log",
    benchmark:
        f"{BENCHMARKS}/prepare_target.tsv",
    shell:
        "python -m dflash prepare-target --target {params.target:q} --out {output} > {log} 2>&1"


# Where the network is: the target's snapshot and hub datasets are downloaded once, by the host Snakemake runs on
# (under SLURM, the submit host), into places every job reads (the Hugging Face cache, results/data/hub).
localrules:
    prepare_target,
    fetch_dataset,


rule fetch_dataset:
    output:
        f"{RESULTS}/data/hub/{{dataset}}.parquet",
    wildcard_constraints:
        dataset="[^/]+",
    input:
        stage("fetch-dataset"),
    params:
        prompts=lambda wc: canonical_json(HUB_DATASETS[wc.dataset]),
    conda:
        ENV
    log:
        f"{LOGS}/fetch_dataset_{{dataset}}.log",
    benchmark:
        f"{BENCHMARKS}/fetch_dataset_{{dataset}}.tsv",
    shell:
        "python -m dflash fetch-dataset --prompts {params.prompts:q} --out {output} > {log} 2>&1"


rule prepare_data:
    input:
        stage("prepare-data"),
        local_inputs(CFG.data.prompts.source, embedded=f"{workflow.basedir}/dflash/assets/chat_prompts.jsonl"),
        hub_copies(data_section(transport=False))[0],
        ancient(PREFLIGHT_FAST),
        manifest=plain(rules.prepare_target.output[0]),
        **({"vllm_env": VLLM_ENV_MANIFEST} if VLLM_REGENERATES else {}),
    output:
        samples=f"{RESULTS}/data/train.parquet",
        validation=f"{RESULTS}/data/validation.parquet",
        heldout=f"{RESULTS}/data/heldout.jsonl",
        card=f"{RESULTS}/data/card.json",
    params:
        data=hub_copies(data_section(transport=False))[1],
        seed=CFG.seed,
        out_dir=lambda wc, output: Path(output.samples).parent,
        # Complete chunks of regenerated responses, outside the declared outputs (which Snakemake deletes on
        # failure): a rerun regenerates only what no complete chunk holds.
        chunk_dir=f"{RESULTS}/cache/data",
        vllm_env=lambda wc, input: f"--vllm-env {input.vllm_env}" if VLLM_REGENERATES else "",
    resources:
        # One process per device of the topology regenerates its chunks: resources, not params, so that
        # the same data on another topology is not regenerated (it would be identical).
        **gpu_resources(CFG.topology.nnodes * NODE_GPUS, range(NODE_GPUS)),
        **launch_resources(CFG.topology),
        topology=section("topology", only=["device", "collective_timeout_s"]),
        # How requests reach the servers: a resource, so that changing it regenerates nothing and retrains nothing.
        transport=data_section(transport=True),
    conda:
        ENV
    log:
        f"{LOGS}/prepare_data.log",
    benchmark:
        f"{BENCHMARKS}/prepare_data.tsv",
    shell:
        "{resources.launcher} -m dflash prepare-data --data {params.data:q} --transport {resources.transport:q} --topology {resources.topology:q} --seed {params.seed} "
        "--target-manifest {input.manifest} {params.vllm_env} --out-dir {params.out_dir} --chunk-dir {params.chunk_dir} > {log} 2>&1"
