# Plots and an HTML summary; `snakemake --report results/report.html` bundles them into one page.


rule report:
    input:
        stage("report"),
        metrics=plain(rules.train.output.metrics),
        train_summary=plain(rules.train.output.summary),
        card=plain(rules.prepare_data.output.card),
        eval_summary=plain(rules.evaluate.output.summary),
        per_set=plain(rules.evaluate.output.per_set),
        verify_cost=plain(rules.evaluate.output.verify_cost),
    output:
        curves=report(f"{RESULTS}/report/training_curves.png", caption="../report/training_curves.rst", category="Training"),
        histogram=report(
            f"{RESULTS}/report/acceptance_histogram.png", caption="../report/acceptance_histogram.rst", category="Evaluation"
        ),
        positions=report(
            f"{RESULTS}/report/position_acceptance.png", caption="../report/position_acceptance.rst", category="Evaluation"
        ),
        speedup=report(f"{RESULTS}/report/speedup.png", caption="../report/speedup.rst", category="Evaluation"),
        calibration=report(f"{RESULTS}/report/calibration.png", caption="../report/calibration.rst", category="Evaluation"),
        verify_cost=report(f"{RESULTS}/report/verify_cost.png", caption="../report/verify_cost.rst", category="Evaluation"),
        html=report(f"{RESULTS}/report/summary.html", caption="../report/summary.rst", category="Summary"),
    params:
        out_dir=lambda wc, output: Path(output.html).parent,
    conda:
        ENV
    log:
        f"{LOGS}/report.log",
    shell:
        "python -m dflash report --metrics {input.metrics} --train-summary {input.train_summary} --card {input.card} "
        "--eval-summary {input.eval_summary} --out-dir {params.out_dir} > {log} 2>&1"
