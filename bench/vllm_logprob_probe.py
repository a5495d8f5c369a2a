"""Diagnostic: are the prompt logprobs vLLM returns the strict log_softmax of the logits it computed?

Runs strict vLLM in this process on the fixture, records every logits tensor its LogitsProcessor returns,
and compares vLLM's prompt logprobs with alignaudit_kernels.log_softmax and token_logprobs of those logits
and with torch's log_softmax. Prints counts of differing tokens for each.

    python bench/vllm_logprob_probe.py [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("ALIGNAUDIT_STRICT", "all")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=str(Path(__file__).resolve().parents[1] / "fixtures" / "qwen3-tiny"))
    parser.add_argument("--eager", action="store_true")
    args = parser.parse_args()
    import torch

    import alignaudit_kernels as K
    from alignaudit.engines.vllm import plugin as vllm_plugin

    vllm_plugin.register()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.v1.sample.sampler import Sampler

    print("compute_logprobs:", Sampler.compute_logprobs)
    vocab = json.loads(Path(args.model, "config.json").read_text())["vocab_size"]
    kwargs = {"kv_cache_memory_bytes": 256 << 20}
    if torch.cuda.is_available():
        kwargs["gpu_memory_utilization"] = 0.5
    llm = LLM(
        model=args.model,
        dtype="bfloat16",
        skip_tokenizer_init=True,
        enforce_eager=args.eager,
        max_model_len=1024,
        seed=0,
        **kwargs,
    )
    captured = []
    llm.apply_model(
        lambda m: (
            m.logits_processor.register_forward_hook(lambda mod, inp, out: captured.append(out.detach().clone()))
            and None
        )
    )
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (44, 45, 43)]
    outs = llm.generate(
        [TokensPrompt(prompt_token_ids=p) for p in prompts],
        SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False),
        use_tqdm=False,
    )
    print("logits calls:", [(tuple(c.shape), str(c.dtype), c.stride()) for c in captured])
    # The V1 runner computes each request's prompt logits in a call of its own (len - 1 rows); model runner V2
    # in one call over every scheduled prompt row (sum of the lengths): take each request's rows from either.
    whole = [c for c in captured if c.shape[0] == sum(len(p) for p in prompts)]
    start = 0
    for out, ids in zip(outs, prompts, strict=True):
        vllm_lp = torch.tensor(
            [e[t].logprob for e, t in zip(out.prompt_logprobs[1:], ids[1:], strict=True)], dtype=torch.float32
        )
        own = [c for c in captured if c.shape[0] == len(ids) - 1]
        rows = own[0] if own else whole[0][start : start + len(ids) - 1]
        start += len(ids)
        t = torch.tensor(ids[1:]).to(rows.device)
        mine = K.log_softmax(rows).gather(1, t[:, None])[:, 0].cpu()
        tok = K.token_logprobs(rows, t).cpu()
        ref = rows.float().log_softmax(-1).gather(1, t[:, None])[:, 0].cpu()
        diff = lambda a: int((a.view(torch.int32) != vllm_lp.view(torch.int32)).sum())  # noqa: E731
        print(
            f"prompt of {len(ids)} ({'own call' if own else 'batched call'}): vLLM vs log_softmax {diff(mine)}, "
            f"vs token_logprobs {diff(tok)}, vs torch {diff(ref)} of {len(vllm_lp)}"
        )


if __name__ == "__main__":
    main()
