"""`kvferry make-certs`: secret files are owner-only from the moment they hold a
byte, and the CA key is kept apart from the files every process is handed."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from deploy.certs import make_certs
from deploy.cli import main

pytest.importorskip("cryptography")


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_no_secret_is_ever_readable_by_others(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Under the loosest umask, every permission change is checked: none may find a file
    that already holds data readable by group or others (chmod after writing does)."""
    exposed: list[str] = []
    real_chmod, real_fchmod = os.chmod, os.fchmod

    def check(st: os.stat_result, what: str) -> None:
        if stat.S_ISREG(st.st_mode) and st.st_size > 0 and st.st_mode & 0o077:
            exposed.append(what)

    def chmod(path: str | os.PathLike, mode: int, **kwargs: object) -> None:
        check(os.stat(path), str(path))
        real_chmod(path, mode, **kwargs)

    def fchmod(fd: int, mode: int) -> None:
        check(os.fstat(fd), f"fd {fd}")
        real_fchmod(fd, mode)

    monkeypatch.setattr(os, "chmod", chmod)
    monkeypatch.setattr(os, "fchmod", fchmod)
    old_umask = os.umask(0)
    try:
        (tmp_path / "tls.key").write_text("left by an earlier run")  # 0666 under umask 0
        files = make_certs(tmp_path)
    finally:
        os.umask(old_umask)
    assert exposed == []
    for secret in (files.ca_key, files.key, files.token):
        assert _mode(secret) == 0o600, secret
    assert b"earlier run" not in files.key.read_bytes()


def test_the_ca_key_is_not_among_the_files_to_hand_out(tmp_path: Path,
                                                       capsys: pytest.CaptureFixture) -> None:
    assert main(["make-certs", "--out", str(tmp_path / "certs")]) == 0
    out = tmp_path / "certs"
    assert sorted(p.name for p in out.iterdir()) == ["ca.crt", "private", "tls.crt", "tls.key",
                                                     "token"]
    assert sorted(p.name for p in (out / "private").iterdir()) == ["ca.key"]
    assert _mode(out / "private") == 0o700
    printed = capsys.readouterr().out.splitlines()
    (ca_line,) = [line for line in printed if "ca.key" in line]
    assert ca_line.startswith(str(out / "private" / "ca.key")) and "for no process" in ca_line
    assert all(line.startswith(str(out)) for line in printed) and len(printed) == 5
