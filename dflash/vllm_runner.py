"""Greedy decoding in vLLM, run inside vLLM's own environment by ``dflash.serving``.

    <vllm env>/bin/python dflash/vllm_runner.py request.json result.json

vLLM pins a transformers older than the project's, so it lives in an environment
of its own where this package is not installed: this file imports only vLLM and
the standard library, and is run by its path. The request names the target's
directory, the drafter's (or none: the autoregressive arm), the number of
speculative tokens, and prompts as token ids; the result holds, per prompt, the
output token ids, the seconds it took and vLLM's speculative-decoding counters
over it (read from vLLM's own metrics before and after), and the totals.
Requests run one at a time, as the project's evaluation decodes them.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

# Run by its path, this file has the package's folder first on sys.path, so its modules would shadow installed
# packages of the same name: transformers probes `import kernels` and would import dflash/kernels.py.
sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != Path(__file__).resolve().parent]

COUNTERS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_accepted_tokens")
PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos"


def add(a: list[int], b: list[int], sign: int = 1) -> list[int]:
    """Element-wise ``a + sign * b``, the shorter padded with zeros."""
    return [(a[i] if i < len(a) else 0) + sign * (b[i] if i < len(b) else 0) for i in range(max(len(a), len(b)))]


def counters(llm) -> dict:
    """vLLM's speculative-decoding counters so far (summed over label sets): drafts, draft tokens, accepted tokens,
    and accepted tokens per draft position."""
    values: dict = {name: 0 for name in COUNTERS} | {PER_POSITION: []}
    for metric in llm.get_metrics():
        if metric.name in COUNTERS:
            values[metric.name] += metric.value
        elif metric.name == PER_POSITION:
            values[PER_POSITION] = add(values[PER_POSITION], metric.values)
    return values


def difference(after: dict, before: dict) -> dict:
    return {
        "drafts": after[COUNTERS[0]] - before[COUNTERS[0]],
        "draft_tokens": after[COUNTERS[1]] - before[COUNTERS[1]],
        "accepted_tokens": after[COUNTERS[2]] - before[COUNTERS[2]],
        "accepted_per_position": add(after[PER_POSITION], before[PER_POSITION], -1),
    }


def main(request_path: str, result_path: str) -> None:
    request = json.loads(open(request_path).read())
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    options = {
        "model": request["target"],
        "dtype": request["dtype"],
        "seed": 0,
        "max_model_len": request["max_model_len"],
        "skip_tokenizer_init": True,  # prompts and outputs are token ids
        "disable_log_stats": False,  # the speculative-decoding counters are stats
        "enforce_eager": True,
    }
    if request.get("drafter"):
        options["speculative_config"] = {"method": "dflash", "model": request["drafter"], "num_speculative_tokens": request["num_speculative_tokens"]}
    started = time.perf_counter()
    llm = LLM(**options)
    startup = time.perf_counter() - started
    params = SamplingParams(temperature=0.0, max_tokens=request["max_new_tokens"], stop_token_ids=request["stop_token_ids"], detokenize=False)
    llm.generate([TokensPrompt(prompt_token_ids=request["prompts"][0]["input_ids"])], SamplingParams(temperature=0.0, max_tokens=4, detokenize=False))
    rows = []
    for prompt in request["prompts"]:
        before = counters(llm)
        begin = time.perf_counter()
        output = llm.generate([TokensPrompt(prompt_token_ids=prompt["input_ids"])], params, use_tqdm=False)[0]
        seconds = time.perf_counter() - begin
        rows.append({"id": prompt["id"], "tokens": list(output.outputs[0].token_ids), "seconds": seconds} | difference(counters(llm), before))
    result = {"vllm_version": __import__("vllm").__version__, "startup_seconds": startup, "prompts": rows}
    with open(result_path, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2])
