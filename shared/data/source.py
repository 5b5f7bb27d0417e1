"""Where text comes from, and the Ray Data pipeline read parquet -> tokenise -> pack.

The same code serves both profiles. The full profile reads the real dataset (AG News or
Wikitext parquet from the Hugging Face hub or an S3 mirror) with the real tokenizer; the
smoke profile reads a parquet that :func:`generate_news_corpus` writes locally, in the same
``text,label`` schema, with a BPE tokenizer trained on it, so nothing is downloaded.

The pipeline runs once per dataset and settings: shared/data/packing.py writes its output as
the cached packed dataset that every epoch and every later run reads (shared/data/reader.py).
"""

from __future__ import annotations

import contextlib
import fnmatch
import functools
import math
import os
import random
from dataclasses import dataclass
from typing import Any

import numpy as np

from shared import storage
from shared.storage import atomic_directory

EOS = "<|endoftext|>"
# Written last into a generated corpus on object storage: without it the corpus is incomplete.
COMPLETE_MARKER = "_COMPLETE"
GENERATOR_VERSION = 1  # bump when the generated text changes, so caches are rebuilt

# AG News' four classes. Each has its own vocabulary, so the next word is predictable from
# the ones before it (a topic model the tiny GPT learns within a few dozen steps).
_CLASS_WORDS: dict[str, dict[str, list[str]]] = {
    "World": {
        "subject": [
            "the minister",
            "rebels",
            "the president",
            "diplomats",
            "the army",
            "protesters",
            "the un",
        ],
        "verb": ["condemned", "signed", "rejected", "negotiated", "announced", "protested"],
        "object": [
            "a ceasefire",
            "the treaty",
            "new sanctions",
            "the election",
            "peace talks",
            "aid",
        ],
        "place": ["baghdad", "geneva", "the border", "the capital", "gaza", "kabul"],
    },
    "Sports": {
        "subject": [
            "the striker",
            "the coach",
            "the champions",
            "the rookie",
            "the keeper",
            "fans",
        ],
        "verb": ["scored", "won", "lost", "defended", "celebrated", "missed"],
        "object": ["the final", "a penalty", "the title", "two goals", "the match", "the cup"],
        "place": ["the stadium", "wimbledon", "the league", "overtime", "the playoffs", "athens"],
    },
    "Business": {
        "subject": ["investors", "the bank", "shares", "the company", "analysts", "oil prices"],
        "verb": ["rose", "fell", "reported", "acquired", "forecast", "cut"],
        "object": [
            "quarterly profit",
            "the merger",
            "interest rates",
            "its stake",
            "jobs",
            "earnings",
        ],
        "place": ["wall street", "the market", "tokyo", "the nasdaq", "london", "the economy"],
    },
    "Sci/Tech": {
        "subject": ["researchers", "the software", "nasa", "the chip", "hackers", "the startup"],
        "verb": ["released", "discovered", "launched", "patched", "tested", "unveiled"],
        "object": ["a new processor", "the update", "a probe", "the browser", "a vaccine", "linux"],
        "place": ["the lab", "orbit", "silicon valley", "the web", "mars", "the network"],
    },
}
LABELS = list(_CLASS_WORDS)


def _sentence(rng: random.Random, words: dict[str, list[str]]) -> str:
    subject, verb, obj, place = (
        rng.choice(words[k]) for k in ("subject", "verb", "object", "place")
    )
    return f"{subject} {verb} {obj} in {place} ."


def generate_news_rows(num_rows: int, seed: int) -> list[dict[str, Any]]:
    """Rows in AG News' schema (``text``, ``label`` 0-3); a row stays on one topic."""
    rng = random.Random(seed)
    rows = []
    for _ in range(num_rows):
        label = rng.randrange(len(LABELS))
        words = _CLASS_WORDS[LABELS[label]]
        text = " ".join(_sentence(rng, words) for _ in range(rng.randint(2, 4)))
        rows.append({"text": text, "label": label})
    return rows


def train_bpe_tokenizer(texts: list[str], vocab_size: int, out_dir: str) -> None:
    """A byte-level BPE (GPT-2's scheme) trained on ``texts``, saved so that
    ``AutoTokenizer.from_pretrained(out_dir)`` loads it exactly like the hub's ``gpt2``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS).save_pretrained(out_dir)


@dataclass(frozen=True)
class TextSource:
    """Where a run's text and tokenizer come from (resolved on the driver, before Ray starts)."""

    dataset: str  # parquet file, directory or split pattern (train-*.parquet): local, s3://, hf://
    tokenizer: str  # hub name or local directory
    text_column: str = "text"


def generate_news_corpus(root: str, num_rows: int, seed: int, vocab_size: int = 512) -> TextSource:
    """Write (once) ``train.parquet`` and a BPE tokenizer under ``root``; return the source.

    Cached by content parameters and written to a temp dir that is renamed when complete, so
    an interrupted generation is never picked up by the next run.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    name = f"news-v{GENERATOR_VERSION}-rows{num_rows}-seed{seed}-vocab{vocab_size}"
    final = storage.join(root, name)
    if storage.is_remote(final):  # object storage: generate on this node, upload, marker last
        if not storage.exists(storage.join(final, COMPLETE_MARKER)):
            local = generate_news_corpus(storage.node_local_dir(root), num_rows, seed, vocab_size)
            storage.upload_dir(os.path.dirname(local.dataset), final)
            storage.write_text(storage.join(final, COMPLETE_MARKER), "")
        return TextSource(dataset=storage.join(final, "train.parquet"),
                          tokenizer=storage.join(final, "tokenizer"))  # fmt: skip
    if not os.path.isdir(final):
        with atomic_directory(final) as tmp:
            rows = generate_news_rows(num_rows, seed)
            table = pa.Table.from_pylist(rows)
            # Several row groups, so Ray Data reads it as several blocks, like a real dataset.
            pq.write_table(table, os.path.join(tmp, "train.parquet"), row_group_size=250)
            train_bpe_tokenizer(
                [r["text"] for r in rows], vocab_size, os.path.join(tmp, "tokenizer")
            )
    return TextSource(
        dataset=os.path.join(final, "train.parquet"), tokenizer=os.path.join(final, "tokenizer")
    )


def resolve_text_source(cfg: Any) -> TextSource:
    """The configured dataset/tokenizer, or a generated corpus for whatever is left empty."""
    generated = None
    if not cfg.dataset or not cfg.tokenizer:
        generated = generate_news_corpus(
            storage.join(cfg.storage_path, "_data"), cfg.smoke_rows, cfg.seed
        )
    return TextSource(
        dataset=cfg.dataset or generated.dataset,
        tokenizer=cfg.tokenizer or generated.tokenizer,
        text_column=cfg.text_column,
    )


def _dataset_filesystem(path: str):
    """(pyarrow filesystem, path inside it) for a local path, ``s3://`` or ``hf://`` URI."""
    if path.startswith("hf://"):
        import pyarrow.fs as pafs
        from huggingface_hub import HfFileSystem

        return pafs.PyFileSystem(pafs.FSSpecHandler(HfFileSystem())), path[len("hf://") :]
    return storage.filesystem(path)


def matching_files(pattern: str, filesystem=None) -> tuple[object, list[str]]:
    """(pyarrow filesystem, the sorted files inside it) that a ``*`` pattern matches, on local
    disk, ``s3://`` or ``hf://`` (or inside ``filesystem``, with ``pattern`` a path in it). The
    directories before the last ``/`` are taken literally. ConfigError when nothing matches."""
    import pyarrow.fs as pafs

    from shared.config import ConfigError

    directory, _, name = pattern.rpartition("/")
    if "*" in directory:
        raise ConfigError(f"dataset '{pattern}': only the file name may hold a '*' pattern.")
    fs, inner = (filesystem, directory) if filesystem else _dataset_filesystem(directory)
    listing = fs.get_file_info(pafs.FileSelector(inner, allow_not_found=True))
    files = sorted(
        f.path
        for f in listing
        if f.type == pafs.FileType.File and fnmatch.fnmatch(f.base_name, name)
    )
    if not files:
        raise ConfigError(f"dataset '{pattern}' matches no files.")
    return fs, files


def parquet_files(path: str) -> tuple[object, list[str]]:
    """(pyarrow filesystem, the parquet files a dataset path names): a file, a directory
    (every ``*.parquet`` under it, as Ray reads it) or a ``*`` pattern. ConfigError otherwise."""
    import pyarrow.fs as pafs

    from shared.config import ConfigError

    if "*" in path:  # one split beside others, e.g. .../train-*.parquet
        return matching_files(path)
    fs, inner = _dataset_filesystem(path)
    info = fs.get_file_info(inner)
    if info.type == pafs.FileType.NotFound:
        raise ConfigError(f"dataset '{path}' does not exist.")
    if info.type == pafs.FileType.Directory:
        files = [f for f in fs.get_file_info(pafs.FileSelector(inner, recursive=True))
                 if f.type == pafs.FileType.File]  # fmt: skip
        parquet = sorted(f.path for f in files if f.path.endswith(".parquet"))
        if not parquet:
            found = (
                f" (it has {len(files)} other files, e.g. {files[0].base_name})" if files else ""
            )
            raise ConfigError(
                f"dataset directory '{path}' has no .parquet files{found}; the jobs read "
                "parquet only: convert the data (e.g. pandas.read_csv(...).to_parquet(...))."
            )
        return fs, parquet
    if not inner.endswith(".parquet"):
        raise ConfigError(
            f"dataset '{path}' is not a .parquet file; the jobs read parquet only: convert it "
            "(e.g. pandas.read_csv(...).to_parquet(...)) or point dataset= at a parquet file."
        )
    return fs, [inner]


def check_text_dataset(source: TextSource) -> None:
    """What Ray Data would find out only after the cluster started, from parquet metadata:
    the path holds parquet files (Ray reads only ``*.parquet``), every one is readable and has
    the text column as strings, and together they have rows. Raises ConfigError with one
    sentence, also when the storage itself cannot be reached."""
    import concurrent.futures

    import pyarrow as pa

    from shared.config import ConfigError, first_line

    path = source.dataset
    try:
        fs, files = parquet_files(path)
    except OSError as err:  # no such bucket, no credentials, endpoint down, hub offline ...
        raise ConfigError(f"dataset '{path}' cannot be listed ({first_line(err)}).") from None
    # One footer per file (a GET on object storage), fetched in parallel; the first bad file in
    # listing order is reported, so the message does not depend on thread timing.
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(32, len(files))) as pool:
        footers = list(pool.map(lambda file: _read_footer(fs, file), files))
    rows = 0
    for file, footer in zip(files, footers, strict=True):
        if isinstance(footer, Exception):
            raise ConfigError(
                f"dataset file '{file}' is not readable parquet ({first_line(footer)})."
            )
        schema, num_rows = footer
        if source.text_column not in schema.names:
            raise ConfigError(
                f"dataset file '{file}' has no column '{source.text_column}' (columns: "
                f"{', '.join(schema.names)}); set text_column= to the column holding the text."
            )
        kind = schema.field(source.text_column).type
        if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
            raise ConfigError(
                f"dataset file '{file}' has column '{source.text_column}' of type {kind}, not "
                "text; set text_column= to the column holding the text."
            )
        rows += num_rows
    if not rows:
        raise ConfigError(f"dataset '{path}' has no rows.")


def _read_footer(fs, file: str):
    """(arrow schema, rows) of one parquet file from its footer, or the error reading it."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        with fs.open_input_file(file) as f:
            metadata = pq.ParquetFile(f).metadata
            return metadata.schema.to_arrow_schema(), metadata.num_rows
    except (pa.ArrowException, OSError) as err:
        return err


# ------------------------------------------------------------------------------------------
# tokenisation and packing (runs inside Ray Data tasks)


@functools.lru_cache(maxsize=4)
def load_tokenizer(name_or_dir: str):
    """Cached per process: Ray Data reuses its worker processes across batches."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(local_tokenizer_dir(name_or_dir))


def local_tokenizer_dir(name_or_dir: str) -> str:
    """A tokenizer directory on object storage is copied to this node once (transformers
    reads only local directories or hub names); anything else is returned as it is."""
    if not storage.is_remote(name_or_dir):
        return name_or_dir
    final = storage.node_local_dir(name_or_dir)
    if not os.path.isdir(final):
        with atomic_directory(final) as tmp:  # several Ray Data workers may race here
            storage.download_dir(name_or_dir, tmp)
    return final


def tokenizer_spec(name_or_dir: str) -> dict[str, int]:
    """What the model must agree on with the tokenizer (the driver passes it to workers)."""
    tok = load_tokenizer(name_or_dir)
    return {"vocab_size": len(tok), "eos_token_id": tok.eos_token_id}


def pack_token_ids(token_lists: list[list[int]], eos_id: int, seq_len: int) -> np.ndarray:
    """Concatenate documents (each followed by EOS) and cut into ``[n, seq_len]`` blocks.

    No padding, so every token trains. The tail shorter than ``seq_len`` is dropped; with
    Ray Data batches of hundreds of rows that is under one block per batch.
    """
    flat: list[int] = []
    for ids in token_lists:
        flat.extend(ids)
        flat.append(eos_id)
    n_blocks = len(flat) // seq_len
    return np.asarray(flat[: n_blocks * seq_len], dtype=np.int64).reshape(n_blocks, seq_len)


def tokenize_and_pack(
    batch: dict[str, np.ndarray], tokenizer: str, text_column: str, seq_len: int
) -> dict[str, np.ndarray]:
    """``map_batches`` function: a batch of raw rows in, a batch of packed blocks out."""
    tok = load_tokenizer(tokenizer)
    # Wikitext has many blank lines; they would only add separator tokens.
    texts = [str(t) for t in batch[text_column] if str(t).strip()]
    ids = tok(texts, add_special_tokens=False)["input_ids"]
    return {"input_ids": pack_token_ids(ids, tok.eos_token_id, seq_len)}


# Ray Data 2.60 reads parquet footers in a pool of FooterReader actors, 32 processes by
# default whatever the file count: ~13 CPU-s of process starts for a one-file corpus.
FOOTER_READER_ENV = "RAY_DATA_PARQUET_FOOTER_NUM_ACTORS"
FILES_PER_FOOTER_READER = 10
MAX_FOOTER_READERS = 32


def footer_readers(num_files: int) -> int:
    """Footer-reader actors for a read of ``num_files`` files: one per ten, at most Ray's 32."""
    return max(1, min(MAX_FOOTER_READERS, math.ceil(num_files / FILES_PER_FOOTER_READER)))


@contextlib.contextmanager
def _sized_footer_readers(num_files: int):
    """Ray Data sizes the pool from the environment while it plans the read; a value the user
    set is theirs and stays."""
    if FOOTER_READER_ENV in os.environ:
        yield
        return
    os.environ[FOOTER_READER_ENV] = str(footer_readers(num_files))
    try:
        yield
    finally:
        os.environ.pop(FOOTER_READER_ENV, None)


def _read_parquet(path: str, columns: list[str]):
    import ray.data

    # The files are listed here (file, directory, or one split's pattern; local, s3:// or
    # hf://) so that the footer-reader pool can be sized to them.
    fs, files = parquet_files(path)
    with _sized_footer_readers(len(files)):
        ds = ray.data.read_parquet(files, filesystem=fs)
    return ds.select_columns(columns)


def build_text_dataset(
    source: TextSource, seq_len: int, max_samples: int = 0, rows_per_batch: int = 256
):
    """The lazy Ray Dataset of packed ``input_ids`` blocks that Ray Train shards per worker."""
    ds = _read_parquet(source.dataset, columns=[source.text_column])
    if max_samples:
        ds = ds.limit(max_samples)
    return ds.map_batches(
        tokenize_and_pack,
        fn_kwargs={
            "tokenizer": source.tokenizer,
            "text_column": source.text_column,
            "seq_len": seq_len,
        },
        batch_size=rows_per_batch,
        batch_format="numpy",
    )
