"""TRL's GRPOTrainer on one process with its colocated vLLM, strict (alignaudit.integrations.trl.StrictGRPOTrainer)
or TRL's own, and TRL's logged ``sampling/sampling_logp_difference`` and importance ratio per step.

    python bench/trl_grpo.py MODEL strict|default OUT [--device cpu|cuda] [--steps N] [--dtype D] [--beta B]
                             [--entropy-coef C] [--top-k K] [--top-p P]

Prints ``KERNELS {what TRL's vLLM computes with, read back}`` before training, ``MOVED {parameter tensors, the
names of those training left bit-identical}`` after it and ``RESULT [log rows with the sampling difference]`` last
(tests/integrations/test_trl.py reads them). Settings: 4 generations per prompt, 8 prompts, 8 completion tokens,
temperature 0.7, top-k 20, top-p 0.9 (so vLLM's processed logprobs carry the whole sampling transform; ``--top-k 0
--top-p 1`` for none), learning rate 1e-3 (the weights change, so every sync matters); as TRL trains by default: the
policy's parameters in float32 (``--dtype``, model_init_kwargs' dtype), vLLM in the checkpoint's bf16; TRL's entropy
bonus (``--entropy-coef`` 0.01); ``--beta`` > 0 adds the reference model and TRL's KL (StrictGRPOTrainer takes it
without truncation only: ``--top-k 0 --top-p 1``).
"""

from __future__ import annotations

import argparse
import json
import os
import socket

import torch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("how", choices=("strict", "default"))
    parser.add_argument("out")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "auto"))
    parser.add_argument("--beta", type=float, default=0.0)
    parser.add_argument("--top-k", type=int, default=20)
    parser.add_argument("--top-p", type=float, default=0.9)
    parser.add_argument("--entropy-coef", type=float, default=0.01)
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    # one process: TRL's colocate mode wants a torch.distributed world of one; vLLM's engine core in this process
    os.environ.update(
        {
            "RANK": "0",
            "LOCAL_RANK": "0",
            "WORLD_SIZE": "1",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            "VLLM_CPU_KVCACHE_SPACE": "1",
        }
    )
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    data = Dataset.from_dict(
        {"prompt": ["The quick brown fox", "Numerics of RL:", "One two three", "A short prompt about logprobs"] * 2}
    )

    def reward(completions, **kwargs):
        return [len(c) / 10.0 for c in completions]

    config = GRPOConfig(
        output_dir=args.out,
        use_vllm=True,
        vllm_mode="colocate",
        num_generations=4,
        per_device_train_batch_size=4,
        max_completion_length=8,
        max_steps=args.steps,
        learning_rate=1e-3,
        logging_steps=1,
        report_to=[],
        use_cpu=args.device == "cpu",
        temperature=0.7,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=0,
        vllm_max_model_length=128,
        save_strategy="no",
        model_init_kwargs={"dtype": args.dtype},
        vllm_gpu_memory_utilization=0.3,
        beta=args.beta,
        entropy_coef=args.entropy_coef,
    )
    if args.how == "strict":
        from alignaudit.integrations.trl import StrictGRPOTrainer

        trainer = StrictGRPOTrainer(
            model=args.model, reward_funcs=reward, args=config, train_dataset=data, fail_closed=True
        )
    else:
        from alignaudit import api

        api.keep_vllm_weights()  # vLLM's CPU backend otherwise frees the weights TRL's sync writes into
        trainer = GRPOTrainer(model=args.model, reward_funcs=reward, args=config, train_dataset=data)
    from alignaudit.engines.vllm.weights import kernels_of

    # what TRL's vLLM computes with, read back where its model runs (StrictGRPOTrainer refuses anything not strict)
    print("KERNELS", json.dumps(trainer.vllm_generation.llm.apply_model(kernels_of)[0]), flush=True)
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    trainer.train()
    after = dict(trainer.model.named_parameters())
    unchanged = [
        name for name, p in before.items() if torch.equal(p.view(torch.uint8), after[name].detach().view(torch.uint8))
    ]
    print(
        "MOVED",
        json.dumps({"tensors": len(before), "dtype": str(next(iter(before.values())).dtype), "unchanged": unchanged}),
        flush=True,
    )
    rows = [row for row in trainer.state.log_history if "sampling/sampling_logp_difference/max" in row]
    print("RESULT", json.dumps(rows))


if __name__ == "__main__":
    main()
