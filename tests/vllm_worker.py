"""Run by vLLM's Python: one offline vLLM engine on the CPU, greedy completions printed as JSON.

Usage: vllm_worker.py MODEL LOAD_FORMAT [LOADER_EXTRA_CONFIG_JSON]. The last stdout line is
``{"tokens": [[...], ...]}`` for PROMPTS, 24 greedy tokens each.
"""

from __future__ import annotations

import json
import os
import sys

PROMPTS = ["The weather", "Once upon a time"]


def main() -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # one process: the loader runs here
    from vllm import LLM, SamplingParams

    model, load_format = sys.argv[1], sys.argv[2]
    extra = {"model_loader_extra_config": json.loads(sys.argv[3])} if len(sys.argv) > 3 else {}
    llm = LLM(
        model=model,
        load_format=load_format,
        **extra,
        enforce_eager=True,
        max_model_len=256,
        dtype="bfloat16",
    )
    outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=24, temperature=0))
    print(json.dumps({"tokens": [list(o.outputs[0].token_ids) for o in outputs]}), flush=True)


if __name__ == "__main__":
    main()
