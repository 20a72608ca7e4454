"""Files a user gives, broken in the ways a parser fails beyond its documented error: one line
``error: FILE...`` naming the file (and line), exit code 2, no traceback (``mcore_ext.userfiles``).

The cases are cheap on purpose (``--check`` and CLI entries in this process, no ranks): bytes that
are not UTF-8 (one Latin-1 byte), JSON / YAML nested past Python's recursion limit, and a
top-level value of another type than the reader expects. Chat JSONL lines are tested with the
chat data (tests/unit/test_chat_data.py).
"""

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "tiny_cpu.yaml")

LATIN_1 = b'{"peft_type": "LORA", "r": 8, "note": "caf\xe9"}'
NESTED = b"[" * 100_000


def _one_error(capsys, code, *expected):
    out, err = capsys.readouterr()
    assert code == 2, out + err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert "Traceback" not in out + err
    for text in expected:
        assert text in err, err
    return err


@pytest.mark.parametrize("content, expected", [
    pytest.param(b"[1, 2]", "expected an object at the top level, got a list", id="list"),
    pytest.param(LATIN_1, ":1: not UTF-8 (byte 0xe9 at column 43)", id="latin-1"),
    pytest.param(NESTED, "nested more deeply than Python's recursion limit", id="nested"),
])
def test_lora_init_from_with_a_bad_adapter_config_is_one_line(tmp_path, capsys, content,
                                                                expected):
    from mcore_ext.training import main

    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_bytes(content)
    (adapter / "adapter_model.safetensors").write_bytes(b"")
    code = main(["--config", TINY, "lora.rank=8", f"lora.init_from={adapter}", "--check",
                 "--world-size", "2"])
    _one_error(capsys, code, f"lora.init_from: {adapter / 'adapter_config.json'}", expected)
