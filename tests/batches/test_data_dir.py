"""Where files live: ``<db>-files`` beside the database (or ``--batch-data-dir``); their
content and metadata survive a restart; what a crash could leave behind (a partial write,
a file no row keeps) is removed at start-up, and nothing else in the directory is."""

from __future__ import annotations

import os
import pathlib
import stat
import time
from collections.abc import Iterator
from typing import Any

import pytest

from millm_plugins.batches.disk import DataDir, TooManyLines

from .helpers import jsonl, line, sdk, submit, wait


def test_files_live_beside_the_database_and_survive_a_restart(make_server: Any, tmp_path: pathlib.Path) -> None:
    db = str(tmp_path / "millm.db")
    content = jsonl([line("a", {"model": "tiny", "prompt": "x"}, "/v1/completions")])
    with make_server(db=db) as first:
        uploaded = sdk(first.base_url).files.create(file=("kept.jsonl", content), purpose="batch")
    folder = tmp_path / "millm-files"
    assert (folder / f"{uploaded.id}.jsonl").read_bytes() == content
    leftovers = [folder / "file-OrphanOfACrash0000000.jsonl", folder / "file-PartialWrite0000000000.jsonl.part"]
    for path in leftovers:
        path.write_bytes(b"{}\n")
        os.utime(path, (time.time() - 2 * 3600,) * 2)  # older than any write under way
    young = folder / "file-UploadUnderWay0000000.abc.jsonl.part"  # perhaps another server's
    young.write_bytes(b"{")
    (folder / "notes.jsonl").write_text("someone else's\n")
    with make_server(db=db) as second:
        client = sdk(second.base_url)
        assert [f.id for f in client.files.list()] == [uploaded.id]
        assert client.files.content(uploaded.id).content == content
    assert not any(path.exists() for path in leftovers)
    assert young.exists()
    assert (folder / "notes.jsonl").read_text() == "someone else's\n"


def test_batch_data_dir_chooses_the_folder(make_server: Any, tmp_path: pathlib.Path) -> None:
    folder = tmp_path / "elsewhere"
    with make_server(batch_data_dir=str(folder)) as srv:
        uploaded = sdk(srv.base_url).files.create(file=("in.jsonl", b"{}\n"), purpose="batch")
        assert (folder / f"{uploaded.id}.jsonl").read_bytes() == b"{}\n"


def test_one_server_runs_the_batches_of_a_data_directory(make_server: Any, tmp_path: pathlib.Path) -> None:
    folder = tmp_path / "shared"
    content = jsonl([line("a", {"model": "tiny", "prompt": "x", "max_tokens": 1}, "/v1/completions")])
    with make_server(batch_data_dir=str(folder)) as first, make_server(batch_data_dir=str(folder)) as second:
        client = sdk(second.base_url)  # the second has no lock: it serves the API, runs nothing
        uploaded = client.files.create(file=("in.jsonl", content), purpose="batch")
        batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h")
        time.sleep(1.0)
        assert client.batches.retrieve(batch.id).status == "validating"
        ran = wait(sdk(first.base_url), submit(sdk(first.base_url), content, endpoint="/v1/completions").id)
        assert ran.status == "completed"
    assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700


def test_writes_have_parts_of_their_own_and_leave_nothing_on_error(tmp_path: pathlib.Path) -> None:
    disk = DataDir(str(tmp_path / "d"))

    def failing() -> Iterator[bytes]:
        yield b"{}"
        raise OSError("disk full")

    with pytest.raises(OSError):
        disk.write_lines("file-x", failing())
    assert os.listdir(disk.path) == []
    one, two = disk._part("file-x"), disk._part("file-x")
    assert one[1] != two[1] and one[1].endswith(".jsonl.part")
    for fd, _ in (one, two):
        os.close(fd)


def test_an_upload_past_its_lines_is_refused_before_it_is_read_whole(tmp_path: pathlib.Path) -> None:
    disk = DataDir(str(tmp_path / "d"))
    read = 0

    class Endless:
        def read(self, size: int) -> bytes:
            nonlocal read
            read += 1
            assert read < 100, "read on past the limit"
            return b"{}\n" * 1000

    with pytest.raises(TooManyLines):
        disk.save_upload(Endless(), "file-y", 1 << 40, 5000)  # type: ignore[arg-type]
    assert read <= 6 and os.listdir(disk.path) == []
