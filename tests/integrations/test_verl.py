"""verl's trainer writes rescorable rollout records through alignaudit.integrations.verl, checked against verl 0.9.1's
own classes (DataProto, RayPPOTrainer, its default config) on the CPU; verl's loop itself is not run here.

Chain: a real vLLM rollout (compare --mode rollout: the fixture's prompts, 8 sampled tokens, raw logprobs) laid out
as verl's batch lays it out (prompts left-padded, responses right-padded, attention and response masks,
rollout_log_probs); the hook's records of that batch, rescored by Megatron, give the compare run's numbers bit for
bit (the same tokens, the same lp_train and lp_infer bits). ``setup`` patches RayPPOTrainer so that a config under
which nothing rescorable would be written is refused before verl builds anything.
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


def verl_config(**rollout):
    """verl's own default PPO config (verl/trainer/config/_generated_ppo_trainer.yaml), rollout settings changed."""
    from omegaconf import OmegaConf

    config = OmegaConf.load(os.path.join(os.path.dirname(verl.__file__), "trainer/config/_generated_ppo_trainer.yaml"))
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
        prompts[i, width - n:], responses[i, :r] = ids[:n], ids[n:]
        attention[i, width - n: width + r] = 1
        logprobs[i, :r] = torch.tensor(s["logprob"][s["generated"]].tolist(), dtype=torch.float32)
    return DataProto.from_dict({"prompts": prompts, "responses": responses, "attention_mask": attention,
                                "response_mask": attention[:, width:].clone(), "rollout_log_probs": logprobs})


def test_records_of_verls_batch_rescore_to_the_compare_runs_numbers(rollout_run, tmp_path):
    from alignaudit.integrations.verl import sampling, write_records

    config = verl_config(**{"actor_rollout_ref.rollout.logprobs_mode": "raw_logprobs",
                            "trainer.rollout_data_dir": str(tmp_path / "rollouts")})
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
    for change, says in (({}, "trainer.rollout_data_dir is not set"),
                         ({**data_dir, "actor_rollout_ref.rollout.calculate_log_probs": False}, "calculate_log_probs"),
                         ({**data_dir, "actor_rollout_ref.rollout.logprobs_mode": "processed_logits"},
                          "logprobs_mode='processed_logits' records logits")):
        with pytest.raises(InputError, match=says):  # before verl's own __init__ reads anything else
            RayPPOTrainer(verl_config(**change), tokenizer=None, role_worker_mapping={}, resource_pool_manager=None)
    batch = verl_batch(rollout_run)
    batch.batch["response_mask"][1, 2] = 0  # a tool's token between sampled ones
    with pytest.raises(InputError, match="rollout 1's response mask has holes"):
        rollout_rows(batch, {})
    del batch.batch["rollout_log_probs"]
    with pytest.raises(InputError, match="no rollout_log_probs"):
        rollout_rows(batch, {})
