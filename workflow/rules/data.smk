# The target model and the training data it regenerates.


rule prepare_target:
    output:
        f"{RESULTS}/target/target.json",
    params:
        target=section("target"),
    input:
        package("target"),
    conda:
        ENV
    log:
        f"{LOGS}/prepare_target.log",
    shell:
        "python -m dflash prepare-target --target {params.target:q} --out {output} > {log} 2>&1"


rule prepare_data:
    input:
        package("target", "data"),
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
