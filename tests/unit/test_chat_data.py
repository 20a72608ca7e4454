"""Chat data (``mcore_ext.data.chat``): which tokens carry loss, packing, the rows a micro-batch is
made of, and bad lines refused before training; and the documents of pretraining text
(``data.document_masking``) as a packed batch.

The tokenizer is the repository's tiny ChatML one (configs/sft_tiny/tokenizer, byte-level: every
character is a token, so a token's text is exact). The loss tokens are decoded and compared with
the answers as the template renders them (the answer and ``<|im_end|>\\n``): the expected text is
written here, not derived from the code under test.
"""

import json
from pathlib import Path

import numpy
import pytest

from mcore_ext.data import chat

ROOT = Path(__file__).resolve().parents[2]
TOKENIZER = ROOT / "configs" / "sft_tiny" / "tokenizer"
RECIPE = ROOT / "configs" / "step35_sft_tiny_cpu.yaml"

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Add 1 and 2."},
    {"role": "assistant", "content": "3."},
    {"role": "user", "content": "And 2 and 2?"},
    {"role": "assistant", "content": "4."},
]


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(TOKENIZER, local_files_only=True)


def _loss_text(tokenizer, conversation):
    """The text of the loss tokens, each run of them on its own."""
    runs, current = [], []
    for token, loss in zip(conversation.ids, conversation.loss):
        if loss:
            current.append(int(token))
        elif current:
            runs.append(tokenizer.decode(current))
            current = []
    if current:
        runs.append(tokenizer.decode(current))
    return runs


def test_loss_on_answers_last_turn_and_all(tokenizer):
    full = ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nAdd 1 and 2.<|im_end|>\n"
            "<|im_start|>assistant\n3.<|im_end|>\n<|im_start|>user\nAnd 2 and 2?<|im_end|>\n"
            "<|im_start|>assistant\n4.<|im_end|>\n")
    answers = chat.tokenize_conversation(CONVERSATION, tokenizer, "assistant", "x:1")
    assert tokenizer.decode(answers.ids) == full
    assert _loss_text(tokenizer, answers) == ["3.<|im_end|>\n", "4.<|im_end|>\n"]
    last = chat.tokenize_conversation(CONVERSATION, tokenizer, "last_turn", "x:1")
    assert _loss_text(tokenizer, last) == ["4.<|im_end|>\n"]
    every = chat.tokenize_conversation(CONVERSATION, tokenizer, "all", "x:1")
    assert every.loss.all() and numpy.array_equal(every.ids, answers.ids)


def test_prompt_completion_is_one_user_turn_and_its_answer(tokenizer, tmp_path):
    path = tmp_path / "pc.jsonl"
    path.write_text(json.dumps({"prompt": "Hi?", "completion": "Hello."}) + "\n\n")
    (conversation,) = chat.read_chat_file(str(path), tokenizer, 64).conversations
    assert tokenizer.decode(conversation.ids) == (
        "<|im_start|>user\nHi?<|im_end|>\n<|im_start|>assistant\nHello.<|im_end|>\n")
    assert _loss_text(tokenizer, conversation) == ["Hello.<|im_end|>\n"]


def test_overlong_conversations_are_truncated_or_dropped_and_counted(tokenizer, tmp_path):
    path = tmp_path / "long.jsonl"
    short = {"prompt": "Q", "completion": "A"}  # 23 tokens
    long_answer = {"prompt": "Q", "completion": "A" * 40}
    long_prompt = {"prompt": "Q" * 40, "completion": "A"}  # its answer lies past the cut
    path.write_text("".join(json.dumps(r) + "\n" for r in (short, long_answer, long_prompt)))
    cut = chat.read_chat_file(str(path), tokenizer, 40, overlong="truncate")
    assert (cut.truncated, cut.dropped, len(cut)) == (1, 1, 2)
    assert [len(c.ids) for c in cut.conversations] == [23, 41]
    assert "1 truncated, 1 dropped" in cut.summary(40)
    dropped = chat.read_chat_file(str(path), tokenizer, 40, overlong="drop")
    assert (dropped.truncated, dropped.dropped, len(dropped)) == (0, 2, 1)


def test_packing_is_best_fit_deterministic_and_complete():
    lengths = [5, 7, 3, 8, 1, 2, 6, 4]
    rows = chat.pack_documents(lengths, 8)
    assert rows == [[0, 2], [1, 4], [3], [5, 6], [7]]  # best fit, in order
    assert chat.pack_documents(lengths, 8) == rows
    assert sorted(i for row in rows for i in row) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in row) <= 8 for row in rows)
    assert chat.pack_documents(lengths, 8, pack=False) == [[i] for i in range(len(lengths))]


def test_packing_and_order_follow_the_rule_written_out_so_a_resumed_run_reads_the_same_rows():
    """The bucketed best fit (``pack_rows``) against the rule written out here (every open row
    scanned: the least room that holds the document, the first such row; a new row if none) on
    1,500 documents of random lengths at seq_length 64, unpadded and padded to 4; and a split's
    sample order against RandomState(seed)'s permutation of the rows for each epoch, cut at
    num_samples: what the .npz-era code computed, so a checkpoint's consumed samples name the
    same rows after the change."""
    from megatron.core.datasets.utils import Split

    rng = numpy.random.default_rng(3)
    for multiple in (1, 4):
        lengths = -(-rng.integers(1, 65, 1500) // multiple) * multiple
        rows, free = [], []
        for i, n in enumerate(lengths.tolist()):
            fits = [r for r, f in enumerate(free) if f >= n]
            if not fits:
                rows.append([i])
                free.append(64 - n)
                continue
            best = min(fits, key=lambda r: (free[r], r))
            rows[best].append(i)
            free[best] -= n
        assert chat.pack_documents(lengths, 64) == rows
        assert max(len(row) for row in rows) >= 3  # packed: the rule had choices to make
    docs = [chat.Conversation(numpy.arange(n + 1), numpy.ones(n + 1, dtype=bool))
            for n in rng.integers(1, 40, 300).tolist()]
    config = chat.ChatDatasetConfig(random_seed=7, sequence_length=64, split="1,0,0",
                                    tokenizer=None, hf_tokenizer=None)
    dataset = chat.ChatDataset(chat.ChatFile("mem", docs, 300, 0, 0), "mem", numpy.arange(300),
                               1000, Split.train, config)
    permutations = numpy.random.RandomState(7)
    expected = numpy.concatenate([permutations.permutation(dataset.num_rows)
                                  for _ in range(-(-1000 // dataset.num_rows))])[:1000]
    assert dataset.order.tolist() == expected.tolist()


def test_rows_restart_positions_and_shift_labels_within_each_document():
    from megatron.core.datasets.utils import Split

    def doc(ids, loss):
        return chat.Conversation(numpy.array(ids), numpy.array(loss, dtype=bool))

    docs = [doc([10, 11, 12, 13], [0, 0, 1, 1]), doc([20, 21, 22], [0, 1, 1]),
            doc([30, 31, 32], [0, 1, 1])]
    source = chat.ChatFile("mem", docs, 3, 0, 0)
    config = chat.ChatDatasetConfig(random_seed=1, sequence_length=6, split="1,0,0",
                                    tokenizer=None, hf_tokenizer=None)
    dataset = chat.ChatDataset(source, "mem", numpy.arange(3), 4, Split.train, config)
    assert [[len(d.ids) - 1 for d in row] for row in dataset.rows] == [[3, 2], [2]]
    rows = {int(dataset.order[i]): dataset[i] for i in range(2)}
    assert sorted(rows) == [0, 1]  # an epoch holds every row once
    first = rows[0]
    assert first["tokens"].tolist() == [10, 11, 12, 20, 21, 0]
    assert first["labels"].tolist() == [11, 12, 13, 21, 22, 0]
    assert first["loss_mask"].tolist() == [0, 1, 1, 1, 1, 0]
    assert first["position_ids"].tolist() == [0, 1, 2, 0, 1, 0]
    assert first["lengths"].tolist() == [3, 2, 1]  # the last: padding
    assert rows[1]["lengths"].tolist() == [2, 4]
    assert len(dataset) == 4 and sorted(dataset.order[2:].tolist()) == [0, 1]


def _check_error(tmp_path, capsys, lines, expected, tokenizer_dir=TOKENIZER):
    """The launcher's --check on chat data ``lines``: exit 2 and one line naming file:line."""
    from mcore_ext.training import main

    path = tmp_path / "chat.jsonl"
    path.write_bytes(b"".join((line if isinstance(line, bytes) else line.encode()) + b"\n"
                              for line in lines))
    code = main(["--config", str(RECIPE), "--check", "--world-size", "2", f"data.path={path}",
                 f"data.tokenizer={tokenizer_dir}", f"checkpoint.save={tmp_path / 'ckpt'}",
                 f"checkpoint.load={tmp_path / 'ckpt'}", f"data.cache_dir={tmp_path / 'cache'}"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.count("\n") == 1 and err.startswith(f"error: {path}:{len(lines)}: "), err
    assert expected in err, err
    assert not (tmp_path / "ckpt").exists() and not (tmp_path / "cache").exists()  # no cache


GOOD = json.dumps({"prompt": "Q", "completion": "A"})


@pytest.mark.parametrize("line, expected", [
    ('{"messages": [', "not JSON"),
    (json.dumps({"messages": [{"role": "user", "content": "Q"}]}), "no assistant turn"),
    (json.dumps({"messages": [{"role": "narrator", "content": "Q"},
                              {"role": "assistant", "content": "A"}]}),
     "message 1 has unknown role 'narrator'"),
    (json.dumps({"text": "Q"}), "no 'messages' (nor 'prompt' and 'completion')"),
    # One Latin-1 byte (e acute) in an otherwise valid line.
    pytest.param(b'{"prompt": "caf\xe9", "completion": "A"}',
                 "not UTF-8 (byte 0xe9 at column 16)", id="latin-1"),
    pytest.param("[" * 100_000, "nested more deeply than Python's recursion limit",
                 id="nested"),
])
def test_bad_lines_are_one_error_naming_file_and_line(tmp_path, capsys, line, expected):
    _check_error(tmp_path, capsys, [GOOD, GOOD, line], expected)


def test_a_template_that_does_not_render_is_one_error(tmp_path, capsys):
    folder = tmp_path / "tokenizer"
    folder.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_bytes((TOKENIZER / name).read_bytes())
    # Refuses a system turn anywhere but first, as many released templates do.
    (folder / "chat_template.jinja").write_text(
        "{% for m in messages %}{% if m['role'] == 'system' and not loop.first %}"
        "{{ raise_exception('System message must be first') }}{% endif %}"
        "{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}")
    late_system = json.dumps({"messages": [{"role": "user", "content": "Q"},
                                           {"role": "system", "content": "S"},
                                           {"role": "assistant", "content": "A"}]})
    _check_error(tmp_path, capsys, [GOOD, late_system],
                 "the chat template does not render it: TemplateError: System message must be "
                 "first", tokenizer_dir=folder)


def test_document_masking_splits_text_samples_after_each_end_of_document():
    """megatron's GPTDataset position ids (reset_position_ids) -> THD boundaries one past each
    end-of-document token (the token ends its document), rows side by side."""
    import torch
    from megatron.core.datasets.gpt_dataset import _get_ltor_masks_and_position_ids

    from mcore_ext.training.data import collate_documents

    eod = 9
    rows = [[1, 2, eod, 3, 4, 5, eod, 6], [7, 7, 7, 7, 7, 7, 7, eod]]
    samples = []
    for row in rows:
        tokens = torch.tensor(row)
        _, loss_mask, position_ids = _get_ltor_masks_and_position_ids(
            tokens, eod, reset_position_ids=True, reset_attention_mask=False,
            eod_mask_loss=False, create_attention_mask=False)
        samples.append({"tokens": tokens, "labels": tokens.roll(-1), "loss_mask": loss_mask,
                        "position_ids": position_ids})
    batch = collate_documents(samples)
    assert batch["cu_seqlens"].tolist() == [0, 3, 7, 8, 16]
    assert batch["max_seqlen"] == 8
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1, 2, 3, 0] + list(range(8))]
    assert batch["tokens"].tolist() == [rows[0] + rows[1]]


@pytest.mark.parametrize("split, empty", [("90,10,0", "validation"), ("10,90,0", "training")])
def test_a_split_left_without_conversations_is_one_error_at_validation(tmp_path, capsys, split,
                                                                      empty):
    """Three conversations: megatron's split gives [round(a N), round(b N)) of them to each
    part, so 90,10,0 leaves validation none (2.7 -> 3 .. 3) and 10,90,0 training none (0 .. 0.3
    -> 0). Said at --check, naming data.path and data.split, before any rank starts."""
    from mcore_ext.training import main

    path = tmp_path / "chat.jsonl"
    path.write_text("".join(GOOD + "\n" for _ in range(3)))
    code = main(["--config", str(RECIPE), "--check", "--world-size", "2", f"data.path={path}",
                 f"data.split={split}", f"checkpoint.save={tmp_path / 'ckpt'}",
                 f"checkpoint.load={tmp_path / 'ckpt'}", f"data.cache_dir={tmp_path / 'cache'}"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.count("\n") == 1 and err.startswith("error: "), err
    assert f"data.split='{split}' leaves the {empty} split of data.path='{path}' no " \
           "conversation (3 conversations)" in err, err
    assert not (tmp_path / "ckpt").exists()
    assert path.read_text().count("\n") == 3


@pytest.mark.parametrize("change, expected", [
    (["data.path=[0.5, {missing}, 0.5, {data}]"], "data.path='{missing}' is not a file"),
    (["data.path=[0, {data}, 1, {data}]"], "data.path: the weight of '{data}' must be above 0, got 0.0"),
    (["data.valid_path={missing}"], "data.valid_path='{missing}' is not a file"),
    (["data.source=files", "data.prefix={data}", "data.valid_path={data}"],
     "data.valid_path is read with data.source=chat only, got data.source=files"),
], ids=["missing-file", "zero-weight", "missing-valid", "valid-not-chat"])
def test_bad_blends_are_one_error_at_check(tmp_path, capsys, change, expected):
    from mcore_ext.training import main

    data = tmp_path / "chat.jsonl"
    data.write_text(GOOD + "\n")
    names = {"missing": tmp_path / "missing.jsonl", "data": data}
    code = main(["--config", str(RECIPE), "--check", "--world-size", "2",
                 *[c.format(**names) for c in change], f"checkpoint.save={tmp_path / 'ckpt'}",
                 f"checkpoint.load={tmp_path / 'ckpt'}", f"data.cache_dir={tmp_path / 'cache'}"])
    err = capsys.readouterr().err
    assert code == 2 and err == f"error: {expected.format(**names)}\n", err
    assert not (tmp_path / "cache").exists()


def test_context_parallel_pads_every_document_to_a_multiple_of_2_cp():
    """Under CP 2 (pad_to_multiple 4, megatron's cu_seqlens_padded convention) a document takes
    a multiple of 4 slots: its tokens, then slots without loss; packing counts the padded
    lengths, so a row still holds seq_length slots. Text documents (document_masking) get the
    same padding at collation, and a last padding document evens the micro-batch out."""
    from megatron.core.datasets.utils import Split

    from mcore_ext.training.data import collate_documents, collate_packed

    def doc(ids, loss):
        return chat.Conversation(numpy.array(ids), numpy.array(loss, dtype=bool))

    docs = [doc([10, 11, 12, 13], [0, 0, 1, 1]), doc([20, 21, 22], [0, 1, 1]),
            doc([30, 31, 32], [0, 1, 1])]
    config = chat.ChatDatasetConfig(random_seed=1, sequence_length=8, split="1,0,0",
                                    tokenizer=None, hf_tokenizer=None, pad_to_multiple=4)
    dataset = chat.ChatDataset(chat.ChatFile("mem", docs, 3, 0, 0), "mem", numpy.arange(3), 2,
                               Split.train, config)
    # 3 + 2 positions fit a row of 8 unpadded with the third; padded to 4 each, two do
    assert [[len(d.ids) - 1 for d in row] for row in dataset.rows] == [[3, 2], [2]]
    rows = {int(dataset.order[i]): dataset[i] for i in range(2)}
    first, second = rows[0], rows[1]
    assert first["tokens"].tolist() == [10, 11, 12, 0, 20, 21, 0, 0]
    assert first["labels"].tolist() == [11, 12, 13, 0, 21, 22, 0, 0]
    assert first["loss_mask"].tolist() == [0, 1, 1, 0, 1, 1, 0, 0]
    assert first["position_ids"].tolist() == [0, 1, 2, 3, 0, 1, 2, 3]
    assert first["lengths"].tolist() == [3, 2] and first["padded_lengths"].tolist() == [4, 4]
    assert second["lengths"].tolist() == [2, 4] and second["padded_lengths"].tolist() == [4, 4]
    batch = collate_packed([first, second])
    assert batch["cu_seqlens"].tolist() == [0, 3, 5, 7, 11]
    assert batch["cu_seqlens_padded"].tolist() == [0, 4, 8, 12, 16]
    assert batch["max_seqlen"] == 4 and batch["tokens"].shape == (1, 16)

    eod = 9
    text = [[1, 2, eod, 3, 4, 5, eod, 6], [7, 7, 7, 7, 7, 7, 7, eod]]
    samples = []
    for row in text:
        positions, at = [], 0
        for n in numpy.diff(numpy.append(0, numpy.flatnonzero(numpy.array(row) == eod) + 1)):
            positions += list(range(n))
            at += n
        positions += list(range(len(row) - at))
        samples.append({"tokens": numpy.array(row), "labels": numpy.roll(row, -1),
                        "loss_mask": numpy.ones(8, numpy.float32),
                        "position_ids": numpy.array(positions)})
    batch = collate_documents(samples, multiple=4, total_multiple=8)  # CP 2 x TP 2
    assert batch["cu_seqlens"].tolist() == [0, 3, 7, 8, 16, 20]
    assert batch["cu_seqlens_padded"].tolist() == [0, 4, 8, 12, 20, 24]
    assert batch["tokens"].tolist() == [[1, 2, eod, 0, 3, 4, 5, eod, 6, 0, 0, 0]
                                        + text[1] + [0] * 4]
    assert batch["loss_mask"].tolist() == [[1, 1, 1, 0, 1, 1, 1, 1, 1, 0, 0, 0] + [1] * 8
                                           + [0] * 4]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3] * 3 + list(range(8)) + [0, 1, 2, 3]]


def test_check_takes_chat_data_at_cp2_and_pp2_and_refuses_masked_text_at_cp2_x_pp2(
        tmp_path, capsys):
    """The recipe at TP 1 x CP 2 and at TP 1 x PP 2 passes validation (the old code refused PP 2:
    'data.source=chat trains packed documents at parallelism.pipeline_model_parallel_size=1
    only, got 2'); text with document masking at CP 2 x PP 2, whose micro-batches vary in length,
    is one error naming the fields and values, exit 2, nothing made."""
    from mcore_ext.training import main

    common = ["--config", str(RECIPE), "--check", "--world-size", "2",
              "parallelism.tensor_model_parallel_size=1", "parallelism.sequence_parallel=false",
              f"checkpoint.save={tmp_path / 'ckpt'}", f"checkpoint.load={tmp_path / 'ckpt'}",
              f"data.cache_dir={tmp_path / 'cache'}"]
    assert main(common + ["parallelism.context_parallel_size=2"]) == 0, capsys.readouterr()
    assert main(common + ["parallelism.pipeline_model_parallel_size=2"]) == 0, capsys.readouterr()
    capsys.readouterr()
    text = ["--config", str(ROOT / "configs" / "tiny_cpu.yaml"), "--check", "--world-size", "4",
            "parallelism.tensor_model_parallel_size=1", "parallelism.sequence_parallel=false",
            "data.document_masking=true", "parallelism.context_parallel_size=2",
            f"checkpoint.save={tmp_path / 'ckpt'}", f"checkpoint.load={tmp_path / 'ckpt'}"]
    assert main(text + ["parallelism.pipeline_model_parallel_size=2"]) == 2
    err = capsys.readouterr().err
    assert err == ("error: data.document_masking=true at parallelism.context_parallel_size=2 "
                   "gives micro-batches of varying length, which the pipeline schedule cannot "
                   "send: parallelism.pipeline_model_parallel_size must be 1 there, got 2\n"), err
    assert not (tmp_path / "ckpt").exists()
