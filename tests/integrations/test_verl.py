"""verl's trainer writes rescorable rollout records through alignaudit.integrations.verl, and its FSDP actor computes
vLLM's strict logprob bits, checked against verl 0.9.1's own code (DataProto, RayPPOTrainer, its default config,
FSDPEngine's model building, model inputs and model outputs) on the CPU; verl's loop itself is not run here, nor
FSDPEngine's constructor (its device mesh asks for CUDA).

Chain: a real vLLM rollout (compare --mode rollout: the fixture's prompts, 8 sampled tokens, raw logprobs) laid out
as verl's batch lays it out (prompts left-padded, responses right-padded, attention and response masks,
rollout_log_probs); the hook's records of that batch, rescored by Megatron, give the compare run's numbers bit for
bit (the same tokens, the same lp_train and lp_infer bits). ``setup`` patches RayPPOTrainer so that a config under
which nothing rescorable would be written is refused before verl builds anything.
Strict: a strict vLLM rollout at temperature 0.7 with processed logprobs, rescored as verl's actor rescores it
(old_log_probs: FSDPEngine._build_module, prepare_model_inputs packing the batch without padding, the model under
verl's bf16 autocast, prepare_model_outputs, no_padding_2_padding): every response token's logprob is vLLM's, bit for
bit, with strict_fsdp_engine, and none is without it; the update's forward (with gradient) gives the same bits and a
gradient to every parameter. Each verl setting the strict switch cannot honour is refused;
the step check counts differing bits and stops before the update when asked to fail closed.
"""

from __future__ import annotations

import json
import os

import pandas as pd
import pytest

from alignaudit.commands import cli
from alignaudit.errors import EXIT_OK, InputError

pytestmark = pytest.mark.engines
verl = pytest.importorskip("verl")


@pytest.fixture(scope="module")
def rollout_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("verl") / "compare"
    assert cli.main(["compare", "--mode", "rollout", "--max-new-tokens", "8", "--out", str(out)]) == EXIT_OK
    return out


def verl_config(name: str = "ppo_trainer", **rollout):
    """verl's own default PPO config (verl/trainer/config/_generated_{name}.yaml) with verl's RayPPOTrainer
    (``trainer.use_v1=False``: the records are written by it), settings changed."""
    from omegaconf import OmegaConf

    config = OmegaConf.load(os.path.join(os.path.dirname(verl.__file__), f"trainer/config/_generated_{name}.yaml"))
    OmegaConf.update(config, "trainer.use_v1", False, force_add=True)
    for key, value in rollout.items():
        OmegaConf.update(config, key, value, force_add=True)
    return config


def verl_batch(run):
    """The compare run's rollouts as verl's batch holds them (a DataProto, right after its rollout)."""
    import torch
    from verl import DataProto

    table = pd.read_parquet(run / "infer" / "logprobs.parquet")
    lengths = json.loads((run / "infer" / "manifest.json").read_text())["rollout"]["prompt_lengths"]
    seqs = [group.sort_values("pos") for _, group in table.groupby("seq")]
    width, new = max(lengths), max(len(s) - n for s, n in zip(seqs, lengths, strict=True))
    b = len(seqs)
    prompts, responses = torch.zeros(b, width, dtype=torch.long), torch.zeros(b, new, dtype=torch.long)
    attention, logprobs = torch.zeros(b, width + new, dtype=torch.long), torch.zeros(b, new)
    for i, (s, n) in enumerate(zip(seqs, lengths, strict=True)):
        ids = torch.tensor(s["token_id"].tolist())
        r = len(ids) - n
        prompts[i, width - n :], responses[i, :r] = ids[:n], ids[n:]
        attention[i, width - n : width + r] = 1
        logprobs[i, :r] = torch.tensor(s["logprob"][s["generated"]].tolist(), dtype=torch.float32)
    return DataProto.from_dict(
        {
            "prompts": prompts,
            "responses": responses,
            "attention_mask": attention,
            "response_mask": attention[:, width:].clone(),
            "rollout_log_probs": logprobs,
        }
    )


def test_records_of_verls_batch_rescore_to_the_compare_runs_numbers(rollout_run, tmp_path):
    from alignaudit.integrations.verl import sampling, write_records

    config = verl_config(
        **{
            "actor_rollout_ref.rollout.logprobs_mode": "raw_logprobs",
            "trainer.rollout_data_dir": str(tmp_path / "rollouts"),
        }
    )
    path = write_records(verl_batch(rollout_run), sampling(config), 3, tmp_path / "rollouts")
    assert path.name == "alignaudit-step3.jsonl"
    row = json.loads(path.read_text().splitlines()[0])
    assert (row["temperature"], row["top_k"], row["top_p"], row["logprobs_mode"]) == (1.0, -1, 1.0, "raw")
    out = tmp_path / "rescored"
    assert cli.main(["rescore", str(path), "--train", "megatron", "--out", str(out)]) == EXIT_OK
    compared = json.loads((rollout_run / "summary.json").read_text())["generated"]
    summary = json.loads((out / "summary.json").read_text())
    for key in ("tokens_compared", "mismatches", "ulp_max", "max_abs_diff", "ulp_histogram"):
        assert summary[key] == compared[key], key
    expected = pd.read_parquet(rollout_run / "tokens.parquet")
    expected = expected[expected["generated"]].reset_index(drop=True)
    tokens = pd.read_parquet(out / "tokens.parquet")
    assert tokens["token_id"].tolist() == expected["token_id"].tolist()
    for column in ("lp_train", "lp_infer"):
        assert (tokens[column].to_numpy().view("int32") == expected[column].to_numpy().view("int32")).all()


def test_the_hook_refuses_verl_settings_that_leave_nothing_to_rescore(rollout_run, tmp_path):
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    from alignaudit.integrations.verl import rollout_rows, setup

    setup()
    setup()  # idempotent: one wrapper, not two
    data_dir = {"trainer.rollout_data_dir": str(tmp_path)}
    for change, says in (
        ({}, "trainer.rollout_data_dir is not set"),
        ({**data_dir, "actor_rollout_ref.rollout.calculate_log_probs": False}, "calculate_log_probs"),
        (
            {**data_dir, "actor_rollout_ref.rollout.logprobs_mode": "processed_logits"},
            "logprobs_mode='processed_logits' records logits",
        ),
    ):
        with pytest.raises(InputError, match=says):  # before verl's own __init__ reads anything else
            RayPPOTrainer(verl_config(**change), tokenizer=None, role_worker_mapping={}, resource_pool_manager=None)
    batch = verl_batch(rollout_run)
    batch.batch["response_mask"][1, 2] = 0  # a tool's token between sampled ones
    with pytest.raises(InputError, match="rollout 1's response mask has holes"):
        rollout_rows(batch, {})
    del batch.batch["rollout_log_probs"]
    with pytest.raises(InputError, match="no rollout_log_probs"):
        rollout_rows(batch, {})


@pytest.fixture(scope="module")
def strict_rollout(tmp_path_factory):
    out = tmp_path_factory.mktemp("verl-strict") / "compare"
    assert (
        cli.main(
            [
                "compare",
                "--strict",
                "--mode",
                "rollout",
                "--train",
                "hf",
                "--infer",
                "vllm",
                "--max-new-tokens",
                "8",
                "--temperature",
                "0.7",
                "--infer-opt",
                "logprobs_mode=processed_logprobs",
                "--out",
                str(out),
            ]
        )
        == EXIT_OK
    )
    return out


@pytest.fixture
def one_rank(tmp_path):
    """A gloo process group of one rank (verl's model building asks torch.distributed for the rank)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def old_log_probs(batch, temperature: float, grad: bool = False):
    """verl's actor rescoring ``batch`` (a DataProto after the rollout) as FSDPEngineWithLMHead.forward_step does,
    without FSDP's wrapping: its own _build_module (the fixture's checkpoint, bf16: FSDP's mixed-precision dtype),
    prepare_model_inputs (packed, no padding), the model under bf16 autocast, prepare_model_outputs; the response's
    logprobs [B, R] by its own no_padding_2_padding. ``grad``: as the update's forward (with gradient); returns
    (logprobs, the model)."""
    import torch
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu
    from verl.workers.config import FSDPEngineConfig, HFModelConfig
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead
    from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding

    from helpers import FIXTURE

    b = batch.batch
    ids = torch.cat([b["prompts"], b["responses"]], 1)
    position_ids = (b["attention_mask"].cumsum(-1) - 1).clamp(min=0)
    data = left_right_2_no_padding(
        TensorDict(
            {
                "input_ids": ids,
                "attention_mask": b["attention_mask"],
                "position_ids": position_ids,
                "response_mask": b["response_mask"],
                "prompts": b["prompts"],
                "responses": b["responses"],
            },
            batch_size=ids.shape[0],
        )
    )
    tu.assign_non_tensor(data, temperature=temperature, use_remove_padding=True, calculate_entropy=False)
    engine = object.__new__(FSDPEngineWithLMHead)  # its __init__ builds a CUDA device mesh
    engine.model_config = HFModelConfig(
        path=str(FIXTURE), use_remove_padding=True, override_config={"attn_implementation": "sdpa"}
    )  # no FlashAttention here
    engine.engine_config = FSDPEngineConfig(forward_only=True, model_dtype="bfloat16", use_torch_compile=False)
    engine.device_mesh, engine.use_remove_padding, engine.ulysses_sequence_parallel_size = None, True, 1
    engine.use_ulysses_sp = engine.pad_to_length = engine.pass_packed_cu_seqlens = False
    module = engine._build_module()
    inputs, args = engine.prepare_model_inputs(micro_batch=data)
    with torch.set_grad_enabled(grad), torch.autocast("cpu", dtype=torch.bfloat16):
        output = engine.prepare_model_outputs(module(**inputs, use_cache=False), args, data, None)
    return no_padding_2_padding(output["log_probs"], data), module


def differing(batch, logprobs) -> int:
    """Response tokens whose ``logprobs`` differ in any bit from the batch's rollout_log_probs."""
    import torch

    mask = batch.batch["response_mask"].bool()
    return int(
        (logprobs.float()[mask].view(torch.int32) != batch.batch["rollout_log_probs"][mask].view(torch.int32)).sum()
    )


def test_verls_actor_made_strict_rescores_vllms_strict_rollout_bit_for_bit(strict_rollout, one_rank, monkeypatch):
    import verl.models.transformers.monkey_patch as verl_patches
    from verl.workers.engine.fsdp import transformer_impl

    from alignaudit.inputs.strict_ops import STRICT_OPS
    from alignaudit.integrations.verl import strict_fsdp_engine

    # verl 0.9.1's monkey patch imports a value-head class TRL 1.16 (installed beside it here) no longer has
    monkeypatch.setattr(verl_patches, "is_trl_available", lambda: False)
    for name in ("logprobs_from_logits", "_scale_logits_by_temperature"):  # restored after the test
        monkeypatch.setattr(transformer_impl, name, getattr(transformer_impl, name))
    monkeypatch.setattr(transformer_impl.FSDPEngine, "_build_module", transformer_impl.FSDPEngine._build_module)
    batch = verl_batch(strict_rollout)
    tokens = int(batch.batch["response_mask"].sum())
    assert tokens == 32 and differing(batch, old_log_probs(batch, 0.7)[0]) == tokens  # verl's stock actor: every one
    strict_fsdp_engine(frozenset(STRICT_OPS))
    assert differing(batch, old_log_probs(batch, 0.7)[0]) == 0
    logprobs, model = old_log_probs(batch, 0.7, grad=True)  # the update's forward: the same bits, a gradient
    assert differing(batch, logprobs.detach()) == 0
    logprobs[batch.batch["response_mask"].bool()].sum().backward()
    assert all(p.grad is not None and bool(p.grad.abs().sum() > 0) for p in model.parameters())


def test_the_strict_switch_refuses_verl_settings_it_cannot_honour():
    from alignaudit.integrations.verl import check_strict_config

    ok = {"actor_rollout_ref.rollout.name": "vllm", "actor_rollout_ref.actor.strategy": "fsdp2"}
    check_strict_config(verl_config(**ok))
    for change, says in (
        ({"actor_rollout_ref.actor.strategy": "megatron"}, "built for FSDP"),
        ({"actor_rollout_ref.rollout.name": "sglang"}, "rollout.name=sglang"),
        ({"actor_rollout_ref.actor.ulysses_sequence_parallel_size": 2}, "Ulysses"),
        ({"actor_rollout_ref.model.use_fused_kernels": True}, "use_fused_kernels"),
        ({"actor_rollout_ref.model.use_liger": True}, "use_liger"),
        ({"actor_rollout_ref.model.lora_rank": 8}, "lora_rank"),
        ({"actor_rollout_ref.model.use_remove_padding": False}, "use_remove_padding=False"),
        ({"actor_rollout_ref.actor.fsdp_config.mixed_precision": {"param_dtype": "fp32"}}, "computes in fp32"),
        (
            {"actor_rollout_ref.rollout.temperature": 0.7, "actor_rollout_ref.rollout.logprobs_mode": "raw_logprobs"},
            "records logprobs before",
        ),
        ({"actor_rollout_ref.rollout.top_p": 0.9}, "does not truncate"),
    ):
        with pytest.raises(InputError, match=says):
            check_strict_config(verl_config(**{**ok, **change}))
    for change, says in (
        (
            {
                "actor_rollout_ref.rollout.engine_kwargs.vllm": {"logprobs_mode": "raw_logprobs"},
                "actor_rollout_ref.rollout.temperature": 0.7,
            },
            "records logprobs before",
        ),  # vLLM gets it
        ({"actor_rollout_ref.rollout.quantization": "fp8"}, "quantization=fp8"),
        ({"actor_rollout_ref.actor.fsdp_config.qat.enable": True}, "qat.enable=True"),
        ({"actor_rollout_ref.ref.ulysses_sequence_parallel_size": 2}, "ref.ulysses"),
        ({"actor_rollout_ref.rollout.engine_kwargs.vllm": {"dtype": "float16"}}, "vLLM in float16"),
        ({"actor_rollout_ref.rollout.dtype": "auto"}, "dtype is auto"),
    ):
        with pytest.raises(InputError, match=says):
            check_strict_config(verl_config(**{**ok, **change}))
    with pytest.raises(InputError, match="strategy=megatron: verl's strict actor is built for FSDP"):
        check_strict_config(verl_config("ppo_megatron_trainer", **{"actor_rollout_ref.rollout.name": "vllm"}))
    check_strict_config(
        verl_config(
            **ok, **{"actor_rollout_ref.rollout.top_p": 0.9, "actor_rollout_ref.rollout.logprobs_mode": "raw_logprobs"}
        )
    )
    check_strict_config(
        verl_config(
            **ok,
            **{
                "actor_rollout_ref.actor.fsdp_config.mixed_precision": {"param_dtype": "16"},
                "actor_rollout_ref.rollout.dtype": "float16",
            },
        )
    )  # verl's spellings of one dtype
    bypass = verl_config(**ok, **{"algorithm.rollout_correction": {"bypass_mode": True}})
    check_strict_config(bypass)
    with pytest.raises(InputError, match="bypass_mode=True uses vLLM's logprobs"):
        check_strict_config(bypass, fail_closed=True)


def test_what_the_hook_needs_depends_on_what_it_is_asked():
    """Records only: verl's RayPPOTrainer (v1 keeps rollouts in TransferQueue) and a rollout_data_dir; with strict,
    neither (the strict actor and the step check run in both trainers); rollout logprobs always; no multi-turn
    responses where records are written."""
    from alignaudit.integrations.verl import check_config

    data_dir = {"trainer.rollout_data_dir": "/tmp/r"}
    with pytest.raises(InputError, match="trainer.use_v1=True"):
        check_config(verl_config(**data_dir, **{"trainer.use_v1": True}))
    check_config(verl_config(**{"trainer.use_v1": True}), strict=True)
    check_config(verl_config(), strict=True)
    with pytest.raises(InputError, match="calculate_log_probs=False"):
        check_config(verl_config(**{"actor_rollout_ref.rollout.calculate_log_probs": False}), strict=True)
    with pytest.raises(InputError, match="multi_turn.enable=True"):
        check_config(verl_config(**data_dir, **{"actor_rollout_ref.rollout.multi_turn.enable": True}))
    with pytest.raises(InputError, match="logprobs_mode=None names none"):
        check_config(verl_config(**data_dir, **{"actor_rollout_ref.rollout.logprobs_mode": None}))


def test_every_step_is_checked_before_the_update_and_stops_when_asked(rollout_run, monkeypatch, tmp_path):
    """One ULP in one token's old_log_probs: counted in the step's metrics; with fail-closed the trainer stops there,
    the step's rollouts written first (as records rescore reads) where the trainer has a rollout_data_dir."""
    from types import SimpleNamespace

    from verl.utils.debug import metrics

    from alignaudit.integrations import verl as hook
    from alignaudit.integrations.verl import AlignmentError, _check_every_step, check_alignment

    batch = verl_batch(rollout_run)
    batch.batch["old_log_probs"] = batch.batch["rollout_log_probs"].clone()
    assert check_alignment(batch, fail_closed=True) == {"tokens": 32, "mismatches": 0}
    batch.batch["old_log_probs"][2, 3] = batch.batch["old_log_probs"][2, 3].nextafter(
        batch.batch["old_log_probs"][2, 3].new_tensor(0.0)
    )  # one ULP
    assert check_alignment(batch, fail_closed=False) == {"tokens": 32, "mismatches": 1}
    monkeypatch.setattr(metrics, "calculate_debug_metrics", metrics.calculate_debug_metrics)
    _check_every_step(fail_closed=False)
    seen = metrics.calculate_debug_metrics(batch)  # as the trainer calls it, right after the rescoring
    assert seen["alignaudit/mismatches"] == 1 and seen["training/rollout_probs_diff_max"] > 0
    _check_every_step(fail_closed=True)
    with pytest.raises(AlignmentError, match="1 of 32 response tokens"):
        metrics.calculate_debug_metrics(batch)
    # the RayPPOTrainer this process built: its config and step counter are all the check reads of it
    built = SimpleNamespace(config=verl_config(**{"trainer.rollout_data_dir": str(tmp_path)}), global_steps=4)
    monkeypatch.setitem(hook._TRAINER, "built", built)
    with pytest.raises(AlignmentError, match=f"the step's rollouts are in {tmp_path / 'alignaudit-step4.jsonl'}"):
        metrics.calculate_debug_metrics(batch)
    rows = [json.loads(line) for line in (tmp_path / "alignaudit-step4.jsonl").read_text().splitlines()]
    assert len(rows) == 4 and sum(len(r["logprobs"]) for r in rows) == 32


def test_one_environment_variable_makes_verls_workers_strict(tmp_path):
    """``setup`` (Ray's worker_process_setup_hook) under ALIGNAUDIT_STRICT=all, in a fresh process as Ray starts one:
    verl's FSDP engine takes the strict logprob functions, the step check wraps verl's debug metrics, and the trainer
    refuses a setting the switch cannot honour before verl builds anything."""
    import subprocess
    import sys

    code = """
import os
from omegaconf import OmegaConf
import verl
from alignaudit.integrations.verl import setup
setup()
from verl.workers.engine.fsdp import transformer_impl
from verl.utils.debug import metrics
from verl.trainer.ppo.ray_trainer import RayPPOTrainer
print(transformer_impl.logprobs_from_logits.__module__, transformer_impl._scale_logits_by_temperature.__name__,
      hasattr(metrics.calculate_debug_metrics, "__wrapped__"))
config = OmegaConf.load(os.path.join(os.path.dirname(verl.__file__), "trainer/config/_generated_ppo_trainer.yaml"))
for key, value in {"trainer.rollout_data_dir": "/tmp/x", "actor_rollout_ref.rollout.name": "vllm",
                   "actor_rollout_ref.model.lora_rank": 8}.items():
    OmegaConf.update(config, key, value, force_add=True)
try:
    RayPPOTrainer(config, tokenizer=None, role_worker_mapping={}, resource_pool_manager=None)
except Exception as e:
    print(type(e).__name__, e)
"""
    env = {**os.environ, "ALIGNAUDIT_STRICT": "all", "ALIGNAUDIT_FAIL_CLOSED": "1"}
    out = subprocess.run(
        [sys.executable, "-P", "-c", code], env=env, capture_output=True, text=True, cwd=tmp_path, timeout=300
    )
    lines = out.stdout.strip().splitlines()
    assert out.returncode == 0, out.stderr[-2000:]
    assert lines[-2] == "alignaudit.integrations.verl strict_scale_by_temperature True"
    assert lines[-1].startswith(
        "InputError alignaudit.integrations.verl (ALIGNAUDIT_STRICT): actor_rollout_ref.model.lora_rank > 0"
    )
