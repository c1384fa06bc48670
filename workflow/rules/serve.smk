# The engines a trained drafter is served in. vLLM: its environment (also regeneration's, under data.generation.engine:
# vllm or auto), and the opt-in checks after train, not part of `all`: `snakemake --cores 1 serve_check` (the trained
# drafter in vLLM) and serve_regeneration. llama.cpp, opt-in as well: `snakemake --cores 1 llamacpp_check` (the
# trained drafter in llama-server), after llamacpp_build and llamacpp_convert.


# vLLM pins a transformers older than the project's: it gets a virtual environment of its own.
rule serve_env:
    output:
        env_manifest=VLLM_ENV_MANIFEST,
    params:
        serve=section("serve", only=["requirements", "uninstall"]),
        env=lambda wc, output: Path(output.env_manifest).parent / "env",
        # Under data.generation.engine: auto, a machine where vLLM does not install regenerates on the local engine.
        optional="--optional" if CFG.data.generation.engine == "auto" else "",
    conda:
        ENV
    log:
        f"{LOGS}/serve_env.log",
    benchmark:
        f"{BENCHMARKS}/serve_env.tsv",
    shell:
        "python -m dflash serve-env --serve {params.serve:q} --env {params.env} {params.optional} --out {output.env_manifest} > {log} 2>&1"


rule serve_check:
    input:
        # vllm_runner.py runs in vLLM's environment, by its path.
        stage("serve-check", "vllm_runner"),
        hub_copies(section("eval", only=["block_size", "sets", "target_dtype"]))[0],
        env_manifest=plain(rules.serve_env.output.env_manifest),
        manifest=plain(rules.prepare_target.output[0]),
        drafter=plain(rules.train.output.drafter),
        heldout=plain(rules.prepare_data.output.heldout),
    output:
        summary=f"{RESULTS}/serve/vllm.json",
        per_prompt=f"{RESULTS}/serve/vllm.csv",
    params:
        serve=section("serve", without=["requirements", "uninstall", "llamacpp"]),
        eval=hub_copies(section("eval", only=["block_size", "sets", "target_dtype"]))[1],
        topology=section("topology", only=["device"]),
        out_dir=lambda wc, output: Path(output.summary).parent,
    resources:
        **gpu_resources(1, [0]),
    conda:
        ENV
    log:
        f"{LOGS}/serve_check.log",
    benchmark:
        f"{BENCHMARKS}/serve_check.tsv",
    shell:
        "python -m dflash serve-check --serve {params.serve:q} --eval {params.eval:q} --topology {params.topology:q} "
        "--env-manifest {input.env_manifest} --target-manifest {input.manifest} --drafter {input.drafter} "
        "--heldout {input.heldout} --out-dir {params.out_dir} > {log} 2>&1"


# vLLM as the regeneration engine: `vllm serve` on 127.0.0.1, started and stopped here, against the local engine.
rule serve_regeneration:
    input:
        stage("serve-regeneration"),
        hub_copies(section("eval", only=["sets"]))[0],
        env_manifest=plain(rules.serve_env.output.env_manifest),
        manifest=plain(rules.prepare_target.output[0]),
        heldout=plain(rules.prepare_data.output.heldout),
    output:
        f"{RESULTS}/serve/regeneration.json",
    params:
        serve=section("serve", only=["limit", "timeout_s"]),
        eval=hub_copies(section("eval", only=["sets"]))[1],
        data=data_section(transport=False),
        topology=section("topology", only=["device"]),
    resources:
        **gpu_resources(1, [0]),
    conda:
        ENV
    log:
        f"{LOGS}/serve_regeneration.log",
    benchmark:
        f"{BENCHMARKS}/serve_regeneration.tsv",
    shell:
        "python -m dflash serve-regeneration --serve {params.serve:q} --eval {params.eval:q} --data {params.data:q} "
        "--topology {params.topology:q} --env-manifest {input.env_manifest} --target-manifest {input.manifest} "
        "--heldout {input.heldout} --out {output} > {log} 2>&1"


# llama.cpp's llama-server, built from the source the pinned llama-cpp-python sdist vendors (dflash/llamacpp.py) into
# the cache ($DFLASH_CACHE_DIR/llama.cpp), once per source and CPU; the manifest says where it is and how long it took.
rule llamacpp_build:
    input:
        stage("llamacpp-build"),
    output:
        f"{RESULTS}/serve/llamacpp/build.json",
    conda:
        ENV
    log:
        f"{LOGS}/llamacpp_build.log",
    benchmark:
        f"{BENCHMARKS}/llamacpp_build.tsv",
    shell:
        "python -m dflash llamacpp-build --out {output} > {log} 2>&1"



# The target and the trained drafter as GGUF files, by the build's vendored converter.
rule llamacpp_convert:
    input:
        stage("llamacpp-convert"),
        build=plain(rules.llamacpp_build.output[0]),
        manifest=plain(rules.prepare_target.output[0]),
        drafter=plain(rules.train.output.drafter),
    output:
        manifest=f"{RESULTS}/serve/llamacpp/gguf.json",
        target=f"{RESULTS}/serve/llamacpp/target.gguf",
        drafter=f"{RESULTS}/serve/llamacpp/drafter.gguf",
    conda:
        ENV
    log:
        f"{LOGS}/llamacpp_convert.log",
    benchmark:
        f"{BENCHMARKS}/llamacpp_convert.tsv",
    shell:
        "python -m dflash llamacpp-convert --build {input.build} --target-manifest {input.manifest} --drafter {input.drafter} "
        "--out {output.manifest} > {log} 2>&1"


# llama-server on 127.0.0.1 with and without the drafter, its acceptance against ours: beside vLLM's in results/serve.
rule llamacpp_check:
    input:
        stage("llamacpp-check"),
        hub_copies(section("eval", only=["block_size", "sets", "target_dtype"]))[0],
        build=plain(rules.llamacpp_build.output[0]),
        ggufs=plain(rules.llamacpp_convert.output.manifest),
        manifest=plain(rules.prepare_target.output[0]),
        drafter=plain(rules.train.output.drafter),
        heldout=plain(rules.prepare_data.output.heldout),
    output:
        summary=f"{RESULTS}/serve/llamacpp.json",
        per_prompt=f"{RESULTS}/serve/llamacpp.csv",
    params:
        serve=section("serve", only=["limit", "max_new_tokens", "tolerance", "llamacpp"]),
        eval=hub_copies(section("eval", only=["block_size", "sets", "target_dtype"]))[1],
        topology=section("topology", only=["device"]),
        out_dir=lambda wc, output: Path(output.summary).parent,
    conda:
        ENV
    log:
        f"{LOGS}/llamacpp_check.log",
    benchmark:
        f"{BENCHMARKS}/llamacpp_check.tsv",
    shell:
        "python -m dflash llamacpp-check --serve {params.serve:q} --eval {params.eval:q} --topology {params.topology:q} "
        "--build {input.build} --ggufs {input.ggufs} --target-manifest {input.manifest} --drafter {input.drafter} "
        "--heldout {input.heldout} --out-dir {params.out_dir} > {log} 2>&1"
