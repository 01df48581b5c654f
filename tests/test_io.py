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


@pytest.mark.parametrize("line, says", [
    (b"42", r"r.jsonl:2: a row must be a JSON object .*, got a number; fix or remove the line"),
    (b'["What is 1 + 1?", "2"]', r"r.jsonl:2: a row must be a JSON object .*, got an array"),
    (b'{"prompt": "caf\xe9"}', r"r.jsonl:2: not UTF-8 text \(0xe9 at byte 16 of the line\); save the file as UTF-8"),
])
def test_a_jsonl_line_that_is_no_object_or_not_utf8_is_named(tmp_path, line, says):
    p = tmp_path / "r.jsonl"
    p.write_bytes(b'{"prompt": "What is 1 + 2?", "answer": "3"}\n' + line + b"\n")
    with pytest.raises(InputError, match=says):
        list(read_jsonl(p))


def test_next_write_removes_temps_a_killed_writer_left_but_not_a_live_ones(tmp_path):
    """A writer killed mid-write (SIGKILL: no cleanup) leaves its temp; the next write of the same target
    removes it. A temp whose writer is alive (here: this process) is kept."""
    import os
    import subprocess
    from grpo_core.io import _temp_prefix
    dead = subprocess.Popen(["true"])
    dead.wait()
    def temp(target: str, pid: int, rest: str):
        return tmp_path / (_temp_prefix(tmp_path / target).replace(f"-{os.getpid()}.", f"-{pid}.") + rest)
    stale_file, live_file, stale_dir = temp("f.txt", dead.pid, "a.tmp"), temp("f.txt", os.getpid(), "b.tmp"), \
        temp("out", dead.pid, "c")
    stale_file.write_text("half")
    live_file.write_text("half")
    (stale_dir / "part").mkdir(parents=True)
    atomic_write_text(tmp_path / "f.txt", "whole")
    atomic_dir(tmp_path / "out", lambda d: (d / "a").write_text("1"))
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["f.txt", "out", live_file.name])


def test_a_directory_is_on_disk_before_its_rename_and_the_rename_before_what_comes_next(tmp_path, monkeypatch):
    """A power cut after a stage record is written must not find the checkpoint it names empty: atomic_dir flushes
    every file it built (and the directories) before the rename, then the rename; atomic_write_text its rename."""
    import os
    from grpo_core import io
    synced, real_fsync = [], os.fsync
    monkeypatch.setattr(io.os, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")), real_fsync(fd)))

    def build(d):
        (d / "checkpoint").mkdir()
        (d / "checkpoint" / "adapter.safetensors").write_bytes(b"w" * 100)
        (d / "trainer_state.pt").write_bytes(b"s" * 100)
    out = atomic_dir(tmp_path / "update", build)
    built = [p for p in synced if "/.update." in p]
    assert {p.rsplit("/.update.", 1)[1].split("/", 1)[-1] for p in built} >= {"checkpoint/adapter.safetensors",
                                                                                "trainer_state.pt", "checkpoint"}
    assert synced[-1] == str(tmp_path)                                        # the rename, after the contents
    synced.clear()
    atomic_write_text(out / "update.json", "{}")
    assert synced[-1] == str(out)


def test_a_jsonl_file_saved_with_a_bom_reads(tmp_path):
    p = tmp_path / "bom.jsonl"
    p.write_bytes(b'\xef\xbb\xbf{"a": 1}\r\n{"a": 2}\r\n')
    assert list(read_jsonl(p)) == [{"a": 1}, {"a": 2}]


def test_yaml_with_a_key_given_twice_is_an_error_naming_key_and_lines():
    import yaml
    from grpo_core.config import yaml_problem
    from grpo_core.io import load_yaml
    with pytest.raises(yaml.YAMLError) as e:
        load_yaml("learning_rate: 1.0e-4\nseed: 1\nlearning_rate: 2.0e-4\n")
    assert yaml_problem(e.value) == ("line 3, column 1: duplicate key 'learning_rate' (first given at line 1); keep "
                                     "one of the two")
    with pytest.raises(yaml.YAMLError, match="duplicate key 'band'"):
        load_yaml("calibration:\n  band: [0.1, 0.9]\n  band: [0.2, 0.8]\n")


def test_yaml_merge_keys_may_still_be_overridden():
    import yaml
    from grpo_core.io import load_yaml
    assert load_yaml("base: &b {x: 1, y: 2}\nd:\n  <<: *b\n  x: 3\n")["d"] == {"x": 3, "y": 2}
    # an anchored mapping that merges and overrides, merged again elsewhere: what safe_load gives, no false duplicate
    nested = "base: &base {x: 1}\ntop: {inner: &mid {<<: *base, x: 2}}\nother: {<<: *mid, y: 3}\n"
    assert load_yaml(nested) == yaml.safe_load(nested)
    with pytest.raises(yaml.YAMLError, match="duplicate key 'a'"):       # inside a list, beside a merge
        load_yaml("items:\n  - {<<: {a: 1}, a: 2, a: 3}\n")
