"""Where files live: ``<db>-files`` beside the database (or ``--batch-data-dir``); their
content and metadata survive a restart; what a crash could leave behind (a partial write,
a file no row keeps) is removed at start-up, and nothing else in the directory is."""

from __future__ import annotations

import pathlib
from typing import Any

from .helpers import jsonl, line, sdk


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
    (folder / "notes.jsonl").write_text("someone else's\n")
    with make_server(db=db) as second:
        client = sdk(second.base_url)
        assert [f.id for f in client.files.list()] == [uploaded.id]
        assert client.files.content(uploaded.id).content == content
    assert not any(path.exists() for path in leftovers)
    assert (folder / "notes.jsonl").read_text() == "someone else's\n"


def test_batch_data_dir_chooses_the_folder(make_server: Any, tmp_path: pathlib.Path) -> None:
    folder = tmp_path / "elsewhere"
    with make_server(batch_data_dir=str(folder)) as srv:
        uploaded = sdk(srv.base_url).files.create(file=("in.jsonl", b"{}\n"), purpose="batch")
        assert (folder / f"{uploaded.id}.jsonl").read_bytes() == b"{}\n"
