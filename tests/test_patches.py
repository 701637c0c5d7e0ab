"""fairseq patched in one place (fairseq_deepinit/patches.py), and fairseq's own tests with the plugin.

- every row of ``PATCHES`` is applied once (a second install changes nothing), each target wraps
  fairseq's own function, and ``Trainer._build_optimizer`` has one wrapper;
- a checkpoint named by ``--finetune-from-model`` exists when fairseq's ``PathManager`` says so (fairseq's
  own test_train mocks it; another storage back-end answers it), and a combination fairseq refuses
  itself reaches fairseq's refusal;
- ``scripts/fairseq_tests.py`` (deepinit_tools/fairseq_tests.py) reports a test that fails only with the
  plugin imported, and exits 1 (on a folder of two stand-in tests: fairseq's own are not in this project).
"""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace
from unittest import mock

import pytest

import fairseq_deepinit  # noqa: F401  (installs the patches)
from conftest import REPO
from fairseq_deepinit import patches
from fairseq_deepinit.checkpoints import resume
from fairseq_deepinit.errors import CheckpointFileError


def _targets():
    from fairseq import checkpoint_utils
    from fairseq.data import data_utils
    from fairseq.trainer import Trainer

    names = ("load_checkpoint", "load_checkpoint_to_cpu", "torch_persistent_save", "save_checkpoint")
    return [getattr(checkpoint_utils, n) for n in names] + [
        checkpoint_utils.verify_checkpoint_directory,
        data_utils.load_indexed_dataset,
        Trainer.load_checkpoint,
        Trainer._build_optimizer,
    ]


def test_every_patch_is_applied_once():
    from fairseq.trainer import Trainer

    before = _targets()
    assert all(getattr(t, patches.MARK, False) for t in before)
    patches.install()  # idempotent
    assert _targets() == before
    # one wrapper of _build_optimizer, around fairseq's own (trainer.py:289)
    assert not getattr(Trainer._build_optimizer.__wrapped__, patches.MARK, False)
    assert Trainer._build_optimizer.__wrapped__.__module__ == "fairseq.trainer"
    assert len({p.target for p in patches.PATCHES}) == len(patches.PATCHES)
    assert all(p.replaces and p.why and p.stock for p in patches.PATCHES)


def _cfg(finetune: str | None, **resets) -> SimpleNamespace:
    flags = dict(reset_optimizer=False, reset_lr_scheduler=False, reset_meters=False, reset_dataloader=False)
    return SimpleNamespace(
        finetune_from_model=finetune, continue_once=None, restore_file="checkpoint_last.pt", **{**flags, **resets}
    )


def test_finetune_checkpoint_exists_when_fairseqs_path_manager_says_so(tmp_path):
    """The first launch of a fine-tuning run: the checkpoint to start from is fairseq's to find."""
    cfg = _cfg(str(tmp_path / "elsewhere" / "pretrained.pt"))
    cfg.save_dir = str(tmp_path)
    trainer = SimpleNamespace(checkpoint_suffix="", data_parallel_rank=0, cfg=SimpleNamespace(model=None))
    original = mock.MagicMock(return_value="loaded")
    with mock.patch("fairseq.file_io.PathManager.exists", return_value=True):
        assert resume.load_checkpoint(original, cfg, trainer) == "loaded"
    original.assert_called_once()
    with mock.patch("fairseq.file_io.PathManager.exists", return_value=False), pytest.raises(CheckpointFileError):
        resume.load_checkpoint(original, cfg, trainer)


def test_finetune_with_a_reset_flag_reaches_fairseqs_own_refusal():
    original = mock.MagicMock(side_effect=ValueError("--finetune-from-model can not be set together with ..."))
    with pytest.raises(ValueError, match="can not be set together"):
        resume.load_checkpoint(original, _cfg("/nowhere.pt", reset_meters=True), SimpleNamespace())


STAND_INS = {
    "__init__.py": "",
    "test_fine.py": "def test_passes():\n    assert True\n",
    "test_plugin.py": (
        "import sys\n\n\ndef test_without_the_plugin_only():\n    assert 'fairseq_deepinit' not in sys.modules\n"
    ),
}


@pytest.mark.slow
def test_fairseq_tests_command_reports_a_test_failing_only_with_the_plugin(tmp_path):
    folder = tmp_path / "tests"
    folder.mkdir()
    for name, text in STAND_INS.items():
        (folder / name).write_text(text)
    run = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "fairseq_tests.py"), str(folder), "--tests", "test_fine.py",
         "test_plugin.py", "--json", str(tmp_path / "out.json")],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 1, run.stdout + run.stderr
    assert "fail only with the plugin: 1" in run.stdout and "test_without_the_plugin_only" in run.stdout
    assert "without the plugin: {'passed': 2" in run.stdout, run.stdout
