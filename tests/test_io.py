"""File helpers: nothing half-written, bad lines named (grpo_core.io)."""
import pytest

from grpo_core.io import InputError, atomic_dir, atomic_write_text, read_json, read_jsonl, write_json, write_jsonl


def test_atomic_write_replaces_whole_file_and_leaves_no_temp(tmp_path):
    p = atomic_write_text(tmp_path / "a" / "f.txt", "old")
    atomic_write_text(p, "new")
    assert p.read_text() == "new"
    assert [x.name for x in p.parent.iterdir()] == ["f.txt"]


def test_atomic_write_failure_keeps_the_old_content(tmp_path):
    p = atomic_write_text(tmp_path / "f.txt", "old")
    with pytest.raises(TypeError):
        atomic_write_text(p, None)                   # fails mid-write
    assert p.read_text() == "old"
    assert [x.name for x in tmp_path.iterdir()] == ["f.txt"]


def test_atomic_dir_all_or_nothing(tmp_path):
    def broken(d):
        (d / "part").write_text("x")
        raise RuntimeError("disk full")
    with pytest.raises(RuntimeError):
        atomic_dir(tmp_path / "out", broken)
    assert list(tmp_path.iterdir()) == []
    atomic_dir(tmp_path / "out", lambda d: (d / "a").write_text("1"))
    atomic_dir(tmp_path / "out", lambda d: (d / "b").write_text("2"))              # kept: first one won
    assert sorted(x.name for x in (tmp_path / "out").iterdir()) == ["a"]
    atomic_dir(tmp_path / "out", lambda d: (d / "b").write_text("2"), replace=True)
    assert sorted(x.name for x in (tmp_path / "out").iterdir()) == ["b"]


def test_json_and_jsonl_round_trip_and_bad_line_is_named(tmp_path):
    write_json(tmp_path / "r.json", {"b": 1, "a": [1, 2]})
    assert read_json(tmp_path / "r.json") == {"a": [1, 2], "b": 1}
    p = write_jsonl(tmp_path / "r.jsonl", [{"x": 1}, {"x": "é"}])
    assert list(read_jsonl(p)) == [{"x": 1}, {"x": "é"}]
    p.write_text(p.read_text() + "\n{broken\n")
    with pytest.raises(InputError, match=r"r.jsonl:4: not valid JSON"):
        list(read_jsonl(p))
