"""The data layer every job reads through (see README "Data"):

source.py    where text comes from (generated smoke corpus, parquet, hub), preflight checks,
             tokenise + pack functions and the Ray Data tokenising pipeline
packing.py   tokenise and pack once into a cached, versioned dataset with stable sample ids
order.py     each epoch's order from (seed, epoch); which rank reads which positions
position.py  the checkpoint's record of consumed samples (compact ranges / bitmap)
reader.py    a rank's micro-batches of an epoch, read through Ray Data (or pyarrow / memory)
"""

from shared.data.order import epoch_order, reader_micro_batches, usable_samples
from shared.data.packing import (
    PackedDataset,
    check_enough_samples,
    check_packed,
    find_packed,
    load_packed,
    packed_dataset,
)
from shared.data.position import decode_consumed, encode_consumed, to_ranges
from shared.data.reader import EpochReader, arrow_rows, memory_rows, ray_rows
from shared.data.source import (
    EOS,
    LABELS,
    TextSource,
    build_text_dataset,
    check_text_dataset,
    generate_news_corpus,
    generate_news_rows,
    load_tokenizer,
    local_tokenizer_dir,
    matching_files,
    pack_token_ids,
    parquet_files,
    resolve_text_source,
    tokenize_and_pack,
    tokenizer_spec,
    train_bpe_tokenizer,
)

__all__ = [
    "EOS", "LABELS", "EpochReader", "PackedDataset", "TextSource", "arrow_rows",
    "build_text_dataset", "check_enough_samples", "check_packed", "check_text_dataset",
    "decode_consumed", "encode_consumed", "epoch_order", "find_packed",
    "generate_news_corpus", "generate_news_rows", "load_packed", "load_tokenizer",
    "local_tokenizer_dir", "matching_files", "memory_rows", "pack_token_ids", "packed_dataset",
    "parquet_files", "ray_rows",
    "reader_micro_batches", "resolve_text_source", "to_ranges", "tokenize_and_pack",
    "tokenizer_spec", "train_bpe_tokenizer", "usable_samples",
]  # fmt: skip
