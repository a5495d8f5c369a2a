"""Where does one engine's KV-cache decode part from its own prefill? (HF transformers engine.)

A rollout engine samples token t + 1 from the logits of a decode step that sees token t alone and the
cached keys; the trainer recomputes the same logits in one prefill of the whole sequence. Under the strict
path both must give the same bits in every op. This diagnostic runs ``model.generate`` with a forward hook
on every module, then a prefill of the generated sequence, and compares each decode call's rows with the
same positions of the prefill, module by module in the order the modules finish. The first module that
differs while every module before it agrees is the op to fix.

    python bench/decode_vs_prefill.py --model Qwen3-0.6B --random-weights --device cuda --strict all
"""

from __future__ import annotations

import argparse

import torch

from alignaudit.engines.hf.adapter import HFEngine
from alignaudit.inputs.request import EngineSettings
from alignaudit.numerics import ulp_distance
from alignaudit.pipelines.requests import ModelArgs, resolve_model_arg


def record_outputs(model):
    """Forward hooks on every submodule: name -> list of the first tensor of each call's output."""
    calls: dict[str, list[torch.Tensor]] = {}
    handles = []
    for name, module in model.named_modules():
        if not name:
            continue

        def hook(_module, _args, out, name=name):
            t = out[0] if isinstance(out, tuple) else out
            if torch.is_tensor(t):
                calls.setdefault(name, []).append(t.detach().clone())

        handles.append(module.register_forward_hook(hook))
    return calls, handles


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3-tiny")
    ap.add_argument("--random-weights", action="store_true")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--strict", default="all")
    ap.add_argument("--lm-head-dtype", default="model")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--prompts", type=int, default=2)
    args = ap.parse_args()

    spec = resolve_model_arg(ModelArgs(model=args.model, random_weights=args.random_weights))
    engine = HFEngine(
        spec, EngineSettings(dtype=args.dtype, device=args.device, strict=args.strict, lm_head_dtype=args.lm_head_dtype)
    )
    model = engine.model
    differing: dict[str, int] = {}
    first_counts: dict[str, int] = {}
    lp_total = 0
    for i in range(args.prompts):
        g = torch.Generator().manual_seed(100 + i)
        prompt = torch.randint(0, spec.vocab_size, (1, args.prompt_len), generator=g).to(args.device)
        calls, handles = record_outputs(model)
        torch.manual_seed(i)
        with torch.no_grad():
            out = model.generate(
                prompt,
                attention_mask=torch.ones_like(prompt),
                do_sample=True,
                temperature=1.0,
                top_k=None,
                top_p=1.0,
                max_new_tokens=args.new_tokens,
                eos_token_id=[],
                pad_token_id=0,
                output_logits=True,
                return_dict_in_generate=True,
            )
        for h in handles:
            h.remove()
        decode = calls
        full, handles = record_outputs(model)
        sequence = out.sequences
        with torch.no_grad():
            logits = model(sequence[:, :-1]).logits
        generated = sequence[0, args.prompt_len :]
        # the two logprob paths of the engine: rollout (generate's fp32 step logits) and rescoring (prefill)
        rollout_lp = engine.token_logprobs(torch.cat(out.logits), generated)
        rescored_lp = engine.token_logprobs(logits[0, args.prompt_len - 1 :], generated)
        lp_differ = int((rollout_lp != rescored_lp).sum())
        lp_total += lp_differ
        if lp_differ:
            print(
                f"prompt {i}: {lp_differ} of {len(generated)} sampled-token logprobs differ, max "
                f"{int(ulp_distance(rollout_lp.cpu(), rescored_lp.cpu()).max())} ULP (fp32)"
            )
        for h in handles:
            h.remove()
        order = list(decode)  # names in the order their first call finished
        for step in range(len(decode[order[-1]])):
            pos = args.prompt_len - 1 + step  # the row this call's last output row stands for
            first = None
            for name in order:
                if step >= len(decode[name]) or name not in full:
                    continue
                a, b = decode[name][step], full[name][0]
                if a.dim() < 2 or b.dim() < 2 or b.shape[1] <= pos:
                    continue
                row_a, row_b = a[0, -1], b[0, pos]
                if row_a.shape != row_b.shape:
                    continue
                if not torch.equal(row_a, row_b):
                    differing[name] = differing.get(name, 0) + 1
                    if first is None:
                        first = name
                        ulps = ulp_distance(row_a.cpu(), row_b.cpu()) if row_a.is_floating_point() else None
                        worst = int(ulps.max()) if ulps is not None else "n/a"
                        print(
                            f"prompt {i} position {pos}: first differing module {name} "
                            f"({int((row_a != row_b).sum())} of {row_a.numel()} elements, max {worst} ULP)"
                        )
            if first is not None:
                first_counts[first] = first_counts.get(first, 0) + 1
    calls_total = args.prompts * args.new_tokens
    print(f"\n{calls_total} decode rows checked ({args.model}, {args.dtype}, {args.device}, strict={args.strict!r})")
    print(f"sampled-token logprobs differing between generate and prefill: {lp_total} of {calls_total}")
    print("first differing module (rows):", first_counts or "none: every decode row equals its prefill row")
    kinds: dict[str, int] = {}
    for name, n in differing.items():
        kind = name.split(".")[-1]
        kinds[kind] = kinds.get(kind, 0) + n
    print("modules differing anywhere, by kind:", kinds or "none")


if __name__ == "__main__":
    main()
