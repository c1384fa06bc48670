# Plots and an HTML summary; `snakemake --report results/report.html` bundles them into one page.


rule report:
    input:
        package("report"),
        rules.train.output.metrics,
        rules.train.output.summary,
        rules.prepare_data.output.card,
        rules.evaluate.output.summary,
        rules.evaluate.output.per_set,
    output:
        curves=report(f"{RESULTS}/report/training_curves.png", caption="../report/training_curves.rst", category="Training"),
        histogram=report(
            f"{RESULTS}/report/acceptance_histogram.png", caption="../report/acceptance_histogram.rst", category="Evaluation"
        ),
        positions=report(
            f"{RESULTS}/report/position_acceptance.png", caption="../report/position_acceptance.rst", category="Evaluation"
        ),
        speedup=report(f"{RESULTS}/report/speedup.png", caption="../report/speedup.rst", category="Evaluation"),
        html=report(f"{RESULTS}/report/summary.html", caption="../report/summary.rst", category="Summary"),
    params:
        results=RESULTS,
        out_dir=f"{RESULTS}/report",
    log:
        f"{LOGS}/report.log",
    shell:
        "{PY} -m dflash report --results {params.results} --out-dir {params.out_dir} > {log} 2>&1"
