"""`alignaudit` with one refusal taken out: strict MoE in CUDA vLLM with its CUDA graphs on (capabilities.MOE_REFUSED,
"strict vLLM on CUDA with CUDA graphs"). The run that would lift it (issue [27]); not a user path: the refusal stays
until such a run gives 0 mismatching tokens.

    python3 bench/moe_graphs.py compare --model qwen3-moe-tiny --train megatron --infer vllm --strict --device cuda ...

ALIGNAUDIT_MOE_DISPATCH picks the dispatch vLLM's strict MoE layer captures (auto: every_expert while capturing;
grouped: kernels/grouped_linear.py); the engines' manifests record it with the environment.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from alignaudit.commands.cli import main  # noqa: E402
from alignaudit.engines.vllm import VllmKind  # noqa: E402

VllmKind.check_moe = lambda self, spec, settings, flag: None

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
