# The run's report: its plots and one self-contained page (results/report/summary.html) that shows them beside the
# results, the training, the machine, the config's key values and each stage's duration. `snakemake --report
# results/report.html` bundles the page with the plots and tables; `snakemake --cores 1 check_report` renders the
# page in headless Chromium.

rule report:
    input:
        stage("report"),
        metrics=plain(rules.train.output.metrics),
        train_summary=plain(rules.train.output.summary),
        card=plain(rules.prepare_data.output.card),
        eval_summary=plain(rules.evaluate.output.summary),
        per_set=plain(rules.evaluate.output.per_set),
        verify_cost=plain(rules.evaluate.output.verify_cost),
        env=plain(rules.env_check.output[0]),
        target=plain(rules.prepare_target.output[0]),
    output:
        html=report(f"{RESULTS}/report/summary.html", caption="../report/summary.rst", category="Report page"),
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
    params:
        out_dir=lambda wc, output: Path(output.html).parent,
        config_values=report_config_values(REPORT_KEYS),
        # Read where they are, not inputs: a run from before benchmarks were recorded keeps its results.
        benchmarks=BENCHMARKS,
    conda:
        ENV
    log:
        f"{LOGS}/report.log",
    benchmark:
        f"{BENCHMARKS}/report.tsv",
    shell:
        "python -m dflash report --metrics {input.metrics} --train-summary {input.train_summary} --card {input.card} "
        "--eval-summary {input.eval_summary} --env {input.env} --target-manifest {input.target} "
        "--benchmarks {params.benchmarks} --config-values {params.config_values:q} --out-dir {params.out_dir} > {log} 2>&1"


# Opt-in, as it needs Chromium (Debian's `chromium`): the page as a browser lays it out, every image loaded and no
# text overflowing its table, with a screenshot of the whole page kept beside it.
rule check_report:
    input:
        stage("check-report"),
        page=plain(rules.report.output.html),
    output:
        screenshot=f"{RESULTS}/report/summary.png",
        verdict=f"{RESULTS}/report/browser_check.json",
    conda:
        ENV
    log:
        f"{LOGS}/check_report.log",
    benchmark:
        f"{BENCHMARKS}/check_report.tsv",
    shell:
        "python -m dflash check-report --page {input.page} --screenshot {output.screenshot} --out {output.verdict} > {log} 2>&1"
