import numpy as np
import pyarrow.parquet as pq
import pytest

from shared.data import (
    EOS,
    LABELS,
    TextSource,
    generate_news_corpus,
    generate_news_rows,
    load_tokenizer,
    pack_token_ids,
    tokenize_and_pack,
)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> TextSource:
    return generate_news_corpus(str(tmp_path_factory.mktemp("data")), num_rows=400, seed=0)


def test_generated_rows_are_deterministic_and_in_ag_news_schema():
    rows = generate_news_rows(50, seed=1)
    assert rows == generate_news_rows(50, seed=1)
    assert rows != generate_news_rows(50, seed=2)
    assert set(rows[0]) == {"text", "label"}
    assert {r["label"] for r in generate_news_rows(400, seed=0)} == set(range(len(LABELS)))


def test_each_class_has_its_own_vocabulary():
    """The learnable structure: a row's words come from its class's vocabulary."""
    by_label: dict[int, set[str]] = {}
    for row in generate_news_rows(400, seed=0):
        by_label.setdefault(row["label"], set()).update(row["text"].split())
    function_words = {"in", ".", "the", "a"}
    for a in by_label:
        for b in by_label:
            if a < b:
                shared = (by_label[a] & by_label[b]) - function_words
                assert len(shared) < 0.1 * len(by_label[a]), (a, b, shared)


def test_corpus_is_cached_and_tokenizer_loads_offline(corpus, tmp_path):
    again = generate_news_corpus(corpus.dataset.rsplit("/", 2)[0], num_rows=400, seed=0)
    assert again == corpus
    assert pq.read_table(corpus.dataset).num_rows == 400
    tok = load_tokenizer(corpus.tokenizer)
    assert len(tok) == 512 and tok.eos_token == EOS
    text = "the striker scored two goals in the final ."
    assert tok.decode(tok(text)["input_ids"]) == text


def test_pack_concatenates_with_eos_and_drops_the_tail():
    blocks = pack_token_ids([[1, 2, 3], [4, 5], [6, 7, 8, 9]], eos_id=0, seq_len=4)
    # 1 2 3 0 | 4 5 0 6 | 7 8 9 0  -> exactly 3 blocks, no padding
    assert blocks.tolist() == [[1, 2, 3, 0], [4, 5, 0, 6], [7, 8, 9, 0]]
    blocks = pack_token_ids([[1, 2, 3], [4]], eos_id=0, seq_len=4)
    assert blocks.tolist() == [[1, 2, 3, 0]]  # "4 0" is shorter than a block: dropped
    assert blocks.dtype == np.int64


def test_tokenize_and_pack_shapes_and_determinism(corpus):
    texts = pq.read_table(corpus.dataset).column("text").to_numpy()[:64]
    out = tokenize_and_pack({"text": texts}, corpus.tokenizer, "text", 32)
    again = tokenize_and_pack({"text": texts}, corpus.tokenizer, "text", 32)
    assert out["input_ids"].ndim == 2 and out["input_ids"].shape[1] == 32
    np.testing.assert_array_equal(out["input_ids"], again["input_ids"])
    eos = load_tokenizer(corpus.tokenizer).eos_token_id
    # one EOS per document, minus those in the dropped tail
    assert 60 <= int((out["input_ids"] == eos).sum()) <= 64


def test_blank_rows_add_no_tokens(corpus):
    texts = np.array(["the striker scored .", "", "   ", "the bank fell ."], dtype=object)
    with_blanks = tokenize_and_pack({"text": texts}, corpus.tokenizer, "text", 4)
    without = tokenize_and_pack({"text": texts[[0, 3]]}, corpus.tokenizer, "text", 4)
    np.testing.assert_array_equal(with_blanks["input_ids"], without["input_ids"])
