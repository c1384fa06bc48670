# Speculative decoding on the held-out and benchmark sets, against the same loop at block size 1.


rule evaluate:
    input:
        stage("evaluate"),
        # Evaluation sets read from local prompt files.
        [f for s in CFG.eval.sets if s.source not in (HELDOUT, HUMANEVAL) for f in local_inputs(s.source)],
        hub_copies(section("eval"))[0],
        manifest=plain(rules.prepare_target.output[0]),
        drafter=plain(rules.train.output.drafter),
        heldout=plain(rules.prepare_data.output.heldout),
        # The calibration of the drafter's confidence.
        validation=plain(rules.prepare_data.output.validation),
    output:
        summary=report(
            f"{RESULTS}/eval/summary.csv",
            caption="../report/eval_summary.rst",
            category="Evaluation",
        ),
        per_set=expand(f"{RESULTS}/eval/{{name}}.csv", name=[s.name for s in CFG.eval.sets]),
        calibration=f"{RESULTS}/eval/calibration.json",
        verify_cost=f"{RESULTS}/eval/verify_cost.json",
    params:
        eval=hub_copies(section("eval"))[1],
        # Which device decodes: the first GPU on GPU configs.
        topology=section("topology", only=["device"]),
        out_dir=lambda wc, output: Path(output.summary).parent,
    resources:
        # Decoding runs on the first device, which no other job shares meanwhile.
        **gpu_resources(1, [0]),
    conda:
        ENV
    log:
        f"{LOGS}/evaluate.log",
    benchmark:
        f"{BENCHMARKS}/evaluate.tsv",
    shell:
        "python -m dflash evaluate --eval {params.eval:q} --topology {params.topology:q} --target-manifest {input.manifest} "
        "--drafter {input.drafter} --heldout {input.heldout} --validation {input.validation} --out-dir {params.out_dir} > {log} 2>&1"
