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


# The three ways a parser fails beyond its documented error, as whole files.
BROKEN = [
    pytest.param(b'{"a": 1,\n "b": "caf\xe9"}', ":2: not UTF-8 (byte 0xe9 at column 11)",
                 id="latin-1"),
    pytest.param(NESTED, "nested more deeply than Python's recursion limit", id="nested"),
    pytest.param(b"[1, 2]", "expected an object at the top level, got a list", id="list"),
]


@pytest.mark.parametrize("content, expected", [
    pytest.param(b"model:\n  num_layers: 2\n  name: caf\xe9\n",
                 ":3: not UTF-8 (byte 0xe9 at column 12)", id="latin-1"),
    pytest.param(b"model: " + NESTED, "nested more deeply than Python's recursion limit",
                 id="nested"),
    pytest.param(b"- 1\n- 2\n", "must be a mapping of sections, got list", id="list"),
])
def test_a_launcher_config_that_does_not_decode_is_one_line(tmp_path, capsys, content,
                                                            expected):
    from mcore_ext.training import main

    config = tmp_path / "run.yaml"
    config.write_bytes(content)
    code = main(["--config", str(config), "--check"])
    _one_error(capsys, code, str(config), expected)


@pytest.mark.parametrize("line, expected", [
    pytest.param(b'{"text": "caf\xe9"}', "not UTF-8 (byte 0xe9 at column 14)", id="latin-1"),
    pytest.param(NESTED, "nested more deeply than Python's recursion limit", id="nested"),
    pytest.param(b"[1, 2]", "not a JSON object with a 'text' field", id="list"),
])
def test_preprocess_names_the_jsonl_line_that_does_not_decode(tmp_path, capsys, line,
                                                              expected):
    from mcore_ext.data.preprocess import main

    data = tmp_path / "docs.jsonl"
    data.write_bytes(b'{"text": "fine"}\n' + line + b"\n")
    code = main(["--input", str(data), "--output-prefix", str(tmp_path / "out")])
    _one_error(capsys, code, f"{data}:2: ", expected)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["docs.jsonl"]  # nothing written


@pytest.mark.parametrize("content, expected", BROKEN)
def test_hf_plan_with_a_config_json_that_does_not_decode_is_one_line(tmp_path, capsys, content,
                                                                     expected):
    from mcore_ext.hf.__main__ import main

    (tmp_path / "config.json").write_bytes(content)
    code = main(["plan", str(tmp_path)])
    _one_error(capsys, code, str(tmp_path / "config.json"), expected)


@pytest.mark.parametrize("content, expected", BROKEN)
def test_hf_import_names_the_config_json_that_does_not_decode(tmp_path, content, expected):
    from mcore_ext.hf.config import HFConfigError
    from mcore_ext.hf.convert import read_hf_config

    (tmp_path / "config.json").write_bytes(content)
    with pytest.raises(HFConfigError) as caught:
        read_hf_config(str(tmp_path))
    assert str(caught.value).startswith(str(tmp_path / "config.json")) and \
        expected in str(caught.value)


@pytest.mark.parametrize("content, expected", BROKEN)
def test_a_safetensors_index_or_header_that_does_not_decode_names_its_file(tmp_path, content,
                                                                           expected):
    import struct

    from mcore_ext.hf.safetensors_io import SafetensorsError, SafetensorsReader

    index = tmp_path / "index" / "model.safetensors.index.json"
    index.parent.mkdir()
    index.write_bytes(content)
    single = tmp_path / "single" / "model.safetensors"
    single.parent.mkdir()
    header = content.replace(b"\n", b" ")
    single.write_bytes(struct.pack("<Q", len(header)) + header)
    for path, what in ((index, expected), (single, "not a safetensors file")):
        with pytest.raises(SafetensorsError) as caught:
            SafetensorsReader(str(path.parent))
        assert str(caught.value).startswith(str(path)) and what in str(caught.value), \
            str(caught.value)


@pytest.mark.parametrize("name", ["tokenizer_config.json", "tokenizer.json"])
@pytest.mark.parametrize("content, expected", BROKEN)
def test_a_tokenizer_file_that_does_not_decode_is_one_line_naming_it(tmp_path, capsys, name,
                                                                     content, expected):
    from mcore_ext.training import main

    folder = tmp_path / "tokenizer"
    folder.mkdir()
    source = ROOT / "configs" / "sft_tiny" / "tokenizer"
    for file in source.iterdir():
        (folder / file.name).write_bytes(file.read_bytes())
    (folder / name).write_bytes(content)
    code = main(["--config", str(ROOT / "configs" / "step35_sft_tiny_cpu.yaml"), "--check",
                 "--world-size", "2", f"data.tokenizer={folder}",
                 f"data.cache_dir={tmp_path / 'cache'}"])
    _one_error(capsys, code, f"data.tokenizer={str(folder)!r} cannot be loaded",
               str(folder / name), expected)
