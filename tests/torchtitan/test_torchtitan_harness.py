"""What the torchtitan end-to-end tests read, checked on known input (no process started):

* the per-rank lines torchrun's ``--tee 3`` prefixes, torchtitan's step lines, and the
  ``should_commit`` and heal lines of both SDKs (torchft's and ftclient's wording);
* the final-state comparison: equal states give no difference, one changed element gives one;
* the test-time assets: deterministic, a vocabulary that fits the debug model's embeddings, and
  the layout torchtitan's ``c4_test`` loader and tokenizer read;
* the ``torchtitan_full`` marker: deselected unless ``-m`` names it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from support.torchtitan_trainer import TorchtitanTrainer, compare_states, digest, make_assets

torch = pytest.importorskip("torch", reason="torch is not installed")

LOG = """\
[default0]:[titan] 2026-11-29 00:30:04,545 - torchft.manager - INFO - [torchtitan_ft_0:c762/0 - step 0] should_commit=True enough_replicas=True, errored=None
[default0]:[titan] 2026-11-29 00:30:04,652 - root - INFO - step:  5  loss:  7.96628  grad_norm:  1.0897  memory:  0.00GiB(0.00%)
[default1]:[titan] 2026-11-29 00:30:04,700 - ftclient.manager - INFO - [torchtitan_ft_0:c762/1 - step 0] should_commit=False enough_replicas=True errored=None
[default1]:[titan] 2026-11-29 00:30:04,701 - root - INFO - step:  5  loss:  7.96628
[default0]:[titan] 2026-11-29 00:30:05,104 - root - INFO - step:  6  loss:  7.84034  grad_norm:  1.1774
[default1]:[titan] ... - ftclient.manager - INFO - [torchtitan_ft_1:ab/1 - step 3] healing from http://vm:1 (replica rank 0) at max_step=7
[default0]:[titan] ... - torchft.manager - INFO - [torchtitan_ft_1:ab/0 - step 3] healing required, fetching checkpoint metadata
step:  9  loss:  1.0   (a line of torchrun's own, not a rank's)
[default0]:[rank0]: RuntimeError: aten.mm.default got mixed torch.Tensor and DTensor, need to convert all
"""


@pytest.fixture
def trainer(tmp_path: Path) -> TorchtitanTrainer:
    t = TorchtitanTrainer(group=0, line="ftclient", groups=2, steps=10, lighthouse="http://x:1", workdir=tmp_path)
    t.log_path.write_text(LOG)
    return t


def test_steps_commits_and_heals_are_read_per_rank(trainer: TorchtitanTrainer) -> None:
    assert trainer.steps_logged(0) == [(5, 7.96628), (6, 7.84034)]
    assert trainer.steps_logged(1) == [(5, 7.96628)]
    assert trainer.step() == 6
    assert trainer.commits(0) == [(0, True)]
    assert trainer.commits(1) == [(0, False)]
    assert trainer.heals(0) == 1 and trainer.heals(1) == 1
    assert trainer.donor_crashed()


def test_a_failed_commit_or_a_gap_is_not_seamless(trainer: TorchtitanTrainer) -> None:
    trainer.nproc = 2
    problems = trainer.seamless_problems()
    assert any("rank 1: should_commit=False" in p for p in problems), problems
    trainer.log_path.write_text("[default0]:step:  1  loss:  2.0\n[default0]:step:  3  loss:  1.0\n")
    trainer.nproc = 1
    assert any("not consecutive" in p for p in trainer.seamless_problems())
    trainer.log_path.write_text("[default0]:step:  1  loss:  2.0\n[default0]:step:  2  loss:  1.0\n")
    assert trainer.seamless_problems() == []


def test_commands_run_torchtitans_trainer_through_the_shim_and_the_line(tmp_path: Path) -> None:
    ft = TorchtitanTrainer(group=1, line="ftclient", groups=2, steps=7, nproc=2, lighthouse="http://a:1,http://b:2",
                           workdir=tmp_path, args=["--fault_tolerance.semi_sync_method", "None"])
    cmd = ft.command()
    assert cmd[1:5] == ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    shim = cmd.index("-m", 2)
    assert cmd[shim:shim + 3][:2] == ["-m", "ftclient.as_torchft"] and cmd[shim + 2].endswith("cpu_shim.py")
    assert "--fault_tolerance.replica_id=1" in cmd and "--fault_tolerance.group_size=2" in cmd
    assert cmd[-2:] == ["--fault_tolerance.semi_sync_method", "None"]
    plain = TorchtitanTrainer(group=0, line="0.2.0", groups=2, steps=7, lighthouse="http://a:1", workdir=tmp_path)
    assert "ftclient.as_torchft" not in plain.command()
    assert plain.environment()["TORCHFT_LIGHTHOUSE"] == "http://a:1"


def test_states_compare_tensor_by_tensor() -> None:
    a = {"w": torch.arange(6.0).reshape(2, 3), "optimizer.state.w.step": torch.tensor(3.0), "train_state.step": 10}
    b = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in a.items()}
    assert compare_states(a, b) == [] and digest(a) == digest(b)
    b["w"][1, 2] += 1e-6
    problems = compare_states(a, b)
    assert len(problems) == 1 and problems[0].startswith("w: tensors differ") and digest(a) != digest(b)
    b["w"] = a["w"].clone()
    b["train_state.step"] = 11
    assert compare_states(a, b) == ["train_state.step: 10 != 11"]
    del b["w"]
    assert "keys differ" in compare_states(a, b)[0]


def test_assets_are_deterministic_and_fit_the_debug_model(tmp_path: Path) -> None:
    make_assets(tmp_path / "a")
    make_assets(tmp_path / "b")
    for rel in ("tests/assets/c4_test/c4_train.json", "tests/assets/tokenizer/tokenizer.json",
                "tests/assets/tokenizer/tokenizer_config.json"):
        assert (tmp_path / "a" / rel).read_bytes() == (tmp_path / "b" / rel).read_bytes(), rel
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tmp_path / "a/tests/assets/tokenizer/tokenizer.json"))
    assert tok.get_vocab_size() <= 2048  # llama3 debugmodel's embeddings
    config = json.loads((tmp_path / "a/tests/assets/tokenizer/tokenizer_config.json").read_text())
    assert tok.token_to_id(config["bos_token"]) is not None and tok.token_to_id(config["eos_token"]) is not None
    first = json.loads((tmp_path / "a/tests/assets/c4_test/c4_train.json").read_text().splitlines()[0])
    assert set(first) == {"text", "timestamp", "url"} and len(first["text"]) > 100
    assert tok.decode(tok.encode(first["text"]).ids) == first["text"]
