"""The weight-probe verdicts kept under the cache directory follow its rule: directories 0700, files 0600."""

from __future__ import annotations

import json
import stat
from pathlib import Path

from skippy_cache.runtime.weightprobe import ProbeOutcome, Verdicts

PASSED = ProbeOutcome(True, None, "", 0.5)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_verdicts_are_private_and_may_create_the_cache_dir_itself(tmp_path: Path, permissive_umask: None) -> None:
    # The probe runs before the disk tier opens the directory, so it may be what creates it, parents too.
    cache_dir = tmp_path / "home" / "skippy-cache"
    directory = cache_dir / "weight-probes"
    Verdicts(directory).put("test-verdict-files-1", PASSED, {"layout": "plain"})
    assert [mode(p) for p in (tmp_path / "home", cache_dir, directory)] == [0o700, 0o700, 0o700]
    assert [p.name for p in directory.iterdir()] == ["test-verdict-files-1.json"]
    assert mode(directory / "test-verdict-files-1.json") == 0o600


def test_a_leftover_temporary_file_does_not_pass_its_mode_on(tmp_path: Path, permissive_umask: None) -> None:
    leftover = tmp_path / "test-verdict-files-2.json.tmp"
    leftover.write_text("cut short")
    leftover.chmod(0o644)
    Verdicts(tmp_path).put("test-verdict-files-2", PASSED, {"layout": "plain"})
    assert [p.name for p in tmp_path.iterdir()] == ["test-verdict-files-2.json"]
    assert mode(tmp_path / "test-verdict-files-2.json") == 0o600
    assert json.loads((tmp_path / "test-verdict-files-2.json").read_text())["ok"] is True
