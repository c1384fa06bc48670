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
        package("target", "data"),
        local_inputs(CFG.data.prompts.source, embedded=f"{workflow.basedir}/dflash/assets/chat_prompts.jsonl"),
        manifest=rules.prepare_target.output[0],
    output:
        samples=f"{RESULTS}/data/train.parquet",
        heldout=f"{RESULTS}/data/heldout.jsonl",
        card=f"{RESULTS}/data/card.json",
    params:
        data=section("data"),
        seed=CFG.seed,
        out_dir=lambda wc, output: Path(output.samples).parent,
    conda:
        ENV
    log:
        f"{LOGS}/prepare_data.log",
    shell:
        "python -m dflash prepare-data --data {params.data:q} --seed {params.seed} "
        "--target-manifest {input.manifest} --out-dir {params.out_dir} > {log} 2>&1"
