"""Which step shapes change a sequence's logits: the facts that ``engine.batch_invariant`` rests on.

    python bench/invariance.py --model DIR [--device cuda:0] [--batch 16] [--kv-cache-tokens 1024]
                               [--lengths 40,300] [--generated 128]

Loads the model (its own dtype; bf16 for the generated presets) and, with a decoder as serving builds it (CUDA
graphs on CUDA) and then with a batch-invariant one (``standby.decoder``), compares one sequence's logits:

- ``prefill_rows``: its prompt prefilled alone against in one pass with another prompt of the same length;
- ``decode_batch``: a decode step of its row alone against beside ``--batch`` - 1 other sequences;
- ``decode_kv_length``: a decode step whose KV length bucket is its own against one that another row's position
  makes the longest (the same batch size);
- ``prefill_vs_decode``: the token after its prompt fed by a decode step against prefilled with the prompt (what a
  migrated continuation's first step sees);
- ``continuation``, for each of ``--lengths``: a prompt of that many tokens prefilled and ``--generated`` more fed one
  decode step each beside ``--batch`` - 1 other sequences (as a served request generates them), against the prompt
  and those tokens prefilled at once (what a continuation without replay computes), compared at the last token;
  ``continuation_replayed``: against the prompt prefilled and the tokens fed one decode step each alone (what a
  batch-invariant continuation computes).

Each comparison gives ``equal`` (bitwise), ``max_abs`` (the largest difference) and ``argmax_equal``. The last
stdout line is one JSON object: ``serving`` and ``batch_invariant``, each a dict of those comparisons
(``decode_kv_length`` is not one of the batch-invariant decoder's: its steps read every KV position).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hotweights.cache.loadspec import LoadSpec
from hotweights.standby.decoder import Decoder
from hotweights.standby.model import KVCache, Transformer
from hotweights.standby.weights import load_model

PROMPT_TOKENS = 40  # each sequence's prompt
SEED = 0


def compared(a: torch.Tensor, b: torch.Tensor) -> dict[str, object]:
    return {
        "equal": bool(torch.equal(a, b)),
        "max_abs": float((a - b).abs().max()),
        "argmax_equal": bool(a.argmax() == b.argmax()),
    }


def probe(
    model: Transformer, batch: int, kv_tokens: int, graphs: bool, invariant: bool, lengths: list[int], generated: int
) -> dict[str, object]:
    """The comparisons of the module docstring for one decoder."""
    kv = KVCache.allocate(model.config, model.tp, batch, kv_tokens, model.device, model.dtype)
    decoder = Decoder(model, kv, graphs, invariant)
    decoder.warm_up()
    generator = torch.Generator().manual_seed(SEED)
    prompts = torch.randint(0, model.config.vocab_size, (batch + 1, PROMPT_TOKENS), generator=generator).tolist()
    token, mine = prompts[batch][0], prompts[0]
    result: dict[str, object] = {}
    alone = decoder.prefill(0, [mine])[0]
    if decoder.prefill_fits(2, PROMPT_TOKENS):
        result["prefill_rows"] = compared(alone, decoder.prefill(0, [mine, prompts[1]])[0])
    for slot, prompt in enumerate(prompts[:batch]):  # each alone, as the batch-invariant decoder does
        decoder.prefill(slot, [prompt])
    step_alone = decoder.decode([token], [PROMPT_TOKENS])[0][0]
    others = [p[-1] for p in prompts[1:batch]]
    result["decode_batch"] = compared(step_alone, decoder.decode([token, *others], [PROMPT_TOKENS] * batch)[0][0])
    if not invariant:
        short = decoder.decode([token, others[0]], [PROMPT_TOKENS, PROMPT_TOKENS])[0][0]
        long = decoder.decode([token, others[0]], [PROMPT_TOKENS, kv_tokens - 1])[0][0]
        result["decode_kv_length"] = compared(short, long)
    prefilled = decoder.prefill(0, [[*mine, token]])[0]
    decoder.prefill(0, [mine])
    result["prefill_vs_decode"] = compared(decoder.decode([token], [PROMPT_TOKENS])[0][0], prefilled)
    for length in lengths:
        prompt, *rest = torch.randint(0, model.config.vocab_size, (batch, length + generated), generator=generator)
        prompt, others = prompt.tolist(), [r.tolist() for r in rest]
        served = fed(decoder, prompt[:length], prompt[length:], others)
        if decoder.prefill_fits(1, length + generated):
            result[f"continuation_{length}"] = compared(served, decoder.prefill(0, [prompt])[0])
        result[f"continuation_replayed_{length}"] = compared(served, fed(decoder, prompt[:length], prompt[length:], []))
    return result


def fed(decoder: Decoder, prompt: list[int], tokens: list[int], others: list[list[int]]) -> torch.Tensor:
    """The logits after ``prompt`` prefilled in slot 0 and ``tokens`` fed one decode step each, ``others`` (prompts
    of the same total length) prefilled in the next slots, one by one, and stepping beside it with their own
    tokens."""
    length = len(prompt)
    for slot, other in enumerate(others, 1):
        decoder.prefill(slot, [other[:length]])
    decoder.prefill(0, [prompt])
    logits = None
    for i, token in enumerate(tokens):
        logits = decoder.decode([token, *(o[length + i] for o in others)], [length + i] * (1 + len(others)))[0][0]
    return logits


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="checkpoint directory")
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--batch", type=int, default=16, help="KV slots, the batch a full step runs (default 16)")
    parser.add_argument("--kv-cache-tokens", type=int, default=1024, help="per slot (default 1024)")
    parser.add_argument(
        "--lengths", type=lambda text: [int(x) for x in text.split(",")], default=[40, 300],
        help="prompt lengths of the continuation probes (default 40,300)",
    )  # fmt: skip
    parser.add_argument("--generated", type=int, default=128, help="tokens fed after each (default 128)")
    args = parser.parse_args()
    longest = max(PROMPT_TOKENS + 1, *(n + args.generated for n in args.lengths))
    if not args.batch >= 2 or args.kv_cache_tokens < longest or min(args.lengths) < 1 or args.generated < 1:
        parser.error(f"--batch >= 2, --lengths and --generated >= 1, --kv-cache-tokens >= {longest} expected")
    model = load_model(Path(args.model), LoadSpec(device=args.device)).model
    graphs = model.device.type == "cuda"
    result = {"model": args.model, "device": args.device, "dtype": str(model.dtype), "batch": args.batch}
    for name, invariant in (("serving", False), ("batch_invariant", True)):
        result[name] = probe(model, args.batch, args.kv_cache_tokens, graphs, invariant, args.lengths, args.generated)
        print(f"{name}: {json.dumps(result[name])}", file=sys.stderr)
        gc.collect()  # the decoder, its KV cache and graphs, before the next one
        if graphs:
            torch.cuda.empty_cache()
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
