"""The fixture's strict HF forward under torch.compile (Inductor) on one device, with the whole traceback of a
failure: where Inductor's code generation of the strict graph breaks, which bench/forward_gpu.py reports in
one line.

    python3 bench/compile_probe.py [--device cuda] [--mask]

--mask passes a right-padded attention mask (the layout check runs in the graph); without it transformers
still builds a 4D mask under torch.compile. Prints whether the compiled logprobs have the eager bits.
"""

from __future__ import annotations

import argparse
import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import alignaudit_kernels as K  # noqa: E402
from alignaudit.engines.hf.strict import make_strict  # noqa: E402
from alignaudit.inputs.strict_ops import STRICT_OPS  # noqa: E402

FIXTURE = str(Path(__file__).resolve().parent.parent / "fixtures" / "qwen3-tiny")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--mask", action="store_true")
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(FIXTURE, dtype=torch.bfloat16, attn_implementation="sdpa")
    model = model.to(args.device).eval()
    make_strict(model, frozenset(STRICT_OPS))
    ids = torch.randint(0, model.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    ids = ids.to(args.device)
    mask = torch.ones_like(ids)
    mask[1, 30:] = 0

    @torch.no_grad()
    def logprobs():
        out = model(ids, attention_mask=mask) if args.mask else model(ids)
        return K.token_logprobs(out.logits[:, :-1], ids[:, 1:])

    eager = logprobs()
    try:
        compiled = torch.compile(logprobs)()
    except Exception:  # noqa: BLE001 - a probe prints the whole failure
        traceback.print_exc()
        return 1
    same = torch.equal(compiled.view(torch.int32), eager.view(torch.int32))
    print(f"compiled strict forward on {args.device}, mask {args.mask}: logprob bits equal to eager: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
