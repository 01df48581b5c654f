import json

import pytest

from grpo_core.task import Task, TaskValidationError, read_tasks, write_tasks


def test_roundtrip_and_hash(tmp_path):
    t = Task(id="a", kind="math", source="s", prompt="1+1?", answer="2")
    p = write_tasks(tmp_path / "t.jsonl", [t])
    assert read_tasks(p) == [t]
    same_content = Task(id="b", kind="math", source="other", prompt="1+1?", answer="2")
    assert t.content_hash() == same_content.content_hash()
    assert not list(tmp_path.glob(".*tmp"))          # no temp files left behind


@pytest.mark.parametrize("row, field", [
    ({"id": "x", "kind": "poem", "source": "s", "prompt": "p"}, "kind"),
    ({"id": "x", "kind": "math", "source": "s", "prompt": "p"}, "answer"),
    ({"id": "x", "kind": "python", "source": "s", "prompt": "p"}, "tests"),
    ({"id": "x", "kind": "math", "source": "s", "prompt": " ", "answer": "1"}, "prompt"),
    ({"id": "x", "kind": "math", "source": "s"}, "prompt"),
    ({"id": "x", "kind": "math", "source": "s", "prompt": "p", "answer": "1", "colour": 1}, "colour"),
])
def test_bad_rows_name_the_field(row, field):
    with pytest.raises(TaskValidationError, match=field):
        Task.from_dict(row)


def test_bad_json_line_names_the_line(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text(json.dumps({"id": "a", "kind": "math", "source": "s", "prompt": "p", "answer": "1"}) + "\n{oops\n")
    with pytest.raises(TaskValidationError, match=":2:"):
        read_tasks(p)
