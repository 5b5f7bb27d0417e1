"""What a driver checks before any cluster starts: the resume contract, the dataset, --help;
and what it prints: strict JSON, filtered Ray output. No Ray needed."""

from __future__ import annotations

import json
import os
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from shared.config import ConfigError, FaultToleranceConfig, TrainConfig, build_config, parse_args
from shared.config.run_settings import SETTINGS_FILE, check_resume
from shared.data import TextSource, check_text_dataset
from shared.data import source as dataset_source
from shared.observability.log_filter import BENIGN, FilteredStream, OutputFilter
from shared.observability.metrics import strict_json

# ------------------------------------------------------------------------------------------
# resume contract


def start(tmp_path, cls=TrainConfig, **overrides):
    cfg = build_config(cls, {"smoke": {}}, "smoke",
                       {"storage_path": str(tmp_path), "run_name": "exp1",
                        **{k: str(v) for k, v in overrides.items()}})  # fmt: skip
    cfg.job = "ddp"
    return cfg


def checkpointed(cfg) -> None:
    """What Ray Train leaves in the run directory after the first checkpoint."""
    os.makedirs(os.path.join(cfg.run_dir, "step_000020"), exist_ok=True)


def trained(tmp_path, cls=TrainConfig, **overrides) -> None:
    """Run exp1's first start, up to its first checkpoint: the next start resumes it."""
    first = start(tmp_path, cls, **overrides)
    check_resume(first)
    checkpointed(first)


def test_the_first_start_records_its_resolved_settings(tmp_path):
    cfg = start(tmp_path, max_steps=20)
    assert check_resume(cfg) == []
    with open(os.path.join(cfg.run_dir, SETTINGS_FILE)) as f:
        saved = json.load(f)
    assert saved["settings"]["max_steps"] == 20 and saved["settings"]["seq_len"] == 64
    assert saved["global_batch_size"] == 16


def test_a_resume_that_changes_seq_len_is_refused_naming_both_values(tmp_path):
    trained(tmp_path)
    with pytest.raises(ConfigError) as err:
        check_resume(start(tmp_path, seq_len=32, micro_batch_size=4))
    message = str(err.value)
    assert "seq_len=64" in message and "seq_len=32" in message
    assert message.count(". ") == 0 and message.endswith(".")  # one sentence


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"micro_batch_size": 4}, "global batch of 16 sequences"),  # 8 x 1 x 2 -> 4 x 1 x 2
        ({"num_workers": 1}, "global batch of 16 sequences"),
        ({"use_gpu": True}, "use_gpu=False"),  # dtype=auto would pick bf16 on the GPU
        ({"model": "gpt2"}, "model=gpt2-tiny"),
        ({"dtype": "bf16"}, "dtype=auto"),
        ({"seed": 1}, "seed=0"),  # the generated dataset depends on it
        ({"lr": 1e-3}, "lr=0.003"),  # the checkpoint's scheduler would keep the old one
    ],
)
def test_changes_that_invalidate_the_checkpoint_are_refused(tmp_path, change, named):
    trained(tmp_path)
    with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
        check_resume(start(tmp_path, **change))


def test_harmless_changes_are_applied_and_listed(tmp_path):
    trained(tmp_path, max_steps=20)
    changes = check_resume(start(tmp_path, max_steps=40, log_every=1, checkpoint_every=5))
    assert changes == ["max_steps 20 -> 40", "checkpoint_every 10 -> 5", "log_every 5 -> 1"]
    # The record now holds this start's settings, so the next resume compares with them.
    assert check_resume(start(tmp_path, max_steps=40, log_every=1, checkpoint_every=5)) == []


def test_without_a_checkpoint_nothing_is_resumed_so_nothing_is_refused(tmp_path):
    check_resume(start(tmp_path))
    assert check_resume(start(tmp_path, seq_len=32)) == []


def test_a_world_size_change_that_keeps_the_global_batch_is_allowed(tmp_path):
    trained(tmp_path)
    assert check_resume(start(tmp_path, num_workers=1, grad_accum=2)) == [
        "num_workers 2 -> 1",
        "grad_accum 1 -> 2",
    ]


def test_a_zero_run_resumes_at_another_world_size_with_the_same_global_batch(tmp_path):
    """DeepSpeed's universal format repartitions a ZeRO checkpoint (shared/parallel/zero.py),
    so a ZeRO run, like fsdp, may change num_workers when the global batch stays."""
    from shared.config import ZeroConfig

    trained(tmp_path, cls=ZeroConfig)
    assert check_resume(start(tmp_path, cls=ZeroConfig, num_workers=1, grad_accum=2)) == [
        "num_workers 2 -> 1",
        "grad_accum 1 -> 2",
    ]
    with pytest.raises(ConfigError, match="global batch"):
        check_resume(start(tmp_path, cls=ZeroConfig, num_workers=1))


def test_a_global_batch_refusal_names_the_settings_that_make_it(tmp_path):
    trained(tmp_path)
    with pytest.raises(ConfigError) as err:
        check_resume(start(tmp_path, grad_accum=2))
    assert str(err.value) == (
        "run ddp/exp1 was trained with a global batch of 16 sequences (micro_batch_size=8 x "
        "grad_accum=1 x num_workers=2) and this start has 32 sequences (micro_batch_size=8 x "
        "grad_accum=2 x num_workers=2), but a step and the data position count that many "
        "sequences: keep the product at 16 to resume it, or start a new run with another "
        "run_name."
    )


def test_an_explicit_dtype_may_move_from_cpu_to_gpu(tmp_path):
    trained(tmp_path, dtype="fp32")
    assert check_resume(start(tmp_path, dtype="fp32", use_gpu=True)) == ["use_gpu False -> True"]


def test_an_elastic_job_may_change_its_world_size(tmp_path):
    """fault_tolerance keeps the checkpoint's global batch (grad_accum adapts) and deals the
    data in one global order, so num_workers is not part of its contract."""
    trained(tmp_path, cls=FaultToleranceConfig)
    assert check_resume(start(tmp_path, cls=FaultToleranceConfig, num_workers=1)) == [
        "num_workers 2 -> 1",
        "global batch kept at 16 sequences (keep_global_batch; grad_accum adapts)",
    ]
    # The record keeps the batch it trains with, so the same command resumes again.
    assert check_resume(start(tmp_path, cls=FaultToleranceConfig, num_workers=1)) == [
        "global batch kept at 16 sequences (keep_global_batch; grad_accum adapts)"
    ]


def test_an_elastic_job_refuses_a_batch_change_the_checkpoint_would_override(tmp_path):
    """keep_global_batch resumes with the checkpoint's batch: grad_accum=4 at the same world
    size was once listed as applied, then silently replaced by the checkpoint's."""
    trained(tmp_path, cls=FaultToleranceConfig)
    with pytest.raises(ConfigError, match="global batch of 16 sequences"):
        check_resume(start(tmp_path, cls=FaultToleranceConfig, grad_accum=4))
    # Matching the checkpoint's batch at another world size is a resize, and fine.
    assert check_resume(start(tmp_path, cls=FaultToleranceConfig, num_workers=1, grad_accum=2)) == [
        "num_workers 2 -> 1",
        "grad_accum 1 -> 2",
    ]


# ------------------------------------------------------------------------------------------
# dataset checks


def parquet(path, table) -> str:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    pq.write_table(table, path)
    return str(path)


def dataset_error(path, column="text") -> str:
    with pytest.raises(ConfigError) as err:
        check_text_dataset(TextSource(dataset=str(path), tokenizer="", text_column=column))
    return str(err.value)


def test_a_text_file_is_refused_as_not_parquet(tmp_path):
    path = tmp_path / "a.txt"
    path.write_text("hello\n")
    assert dataset_error(path) == (
        f"dataset '{path}' is not a .parquet file; the jobs read parquet only: convert it "
        "(e.g. pandas.read_csv(...).to_parquet(...)) or point dataset= at a parquet file."
    )


def test_a_directory_of_csv_and_txt_files_is_refused(tmp_path):
    (tmp_path / "a.csv").write_text("text\nhello\n")
    (tmp_path / "b.txt").write_text("hello\n")
    assert "has no .parquet files (it has 2 other files" in dataset_error(tmp_path)


def test_an_empty_directory_is_refused_in_one_sentence(tmp_path):
    (tmp_path / "d").mkdir()
    assert dataset_error(tmp_path / "d") == (
        f"dataset directory '{tmp_path / 'd'}' has no .parquet files; the jobs read parquet "
        "only: convert the data (e.g. pandas.read_csv(...).to_parquet(...))."
    )


def test_a_file_named_parquet_that_is_not_parquet_is_refused(tmp_path):
    path = tmp_path / "fake.parquet"
    path.write_text("text,label\n")
    assert "is not readable parquet" in dataset_error(path)


def test_a_missing_text_column_names_the_columns_there_are(tmp_path):
    path = parquet(tmp_path / "d.parquet", pa.table({"body": ["a"], "label": [1]}))
    assert "has no column 'text' (columns: body, label)" in dataset_error(path)


def test_an_empty_dataset_is_refused(tmp_path):
    path = parquet(tmp_path / "d" / "part-0.parquet", pa.table({"text": pa.array([], pa.string())}))
    assert dataset_error(os.path.dirname(path)) == f"dataset '{tmp_path / 'd'}' has no rows."


def test_every_file_is_checked_not_only_the_first_with_rows(tmp_path):
    parquet(tmp_path / "d" / "a.parquet", pa.table({"text": ["hello world"]}))
    parquet(tmp_path / "d" / "b.parquet", pa.table({"body": ["no text column"]}))
    assert f"dataset file '{tmp_path / 'd' / 'b.parquet'}' has no column 'text'" in dataset_error(
        tmp_path / "d"
    )
    (tmp_path / "d" / "b.parquet").write_text("not parquet")
    assert "b.parquet' is not readable parquet" in dataset_error(tmp_path / "d")


def test_a_text_column_that_holds_no_text_is_refused(tmp_path):
    path = parquet(tmp_path / "d.parquet", pa.table({"text": [1, 2]}))
    assert dataset_error(path) == (
        f"dataset file '{path}' has column 'text' of type int64, not text; set text_column= to "
        "the column holding the text."
    )


def test_a_good_dataset_passes_after_every_parquet_file_is_read(tmp_path, monkeypatch):
    """What a real dataset directory holds: nested files, an empty file beside files with rows,
    a large_string text column, a marker file that is not parquet; the text under another
    column name. The check reads each parquet footer once and accepts all of it."""
    root = tmp_path / "d"
    parquet(root / "part-0.parquet", pa.table({"body": ["hello world"]}))
    parquet(root / "part-1.parquet", pa.table({"body": pa.array([], pa.string())}))
    wide = pa.table({"body": pa.array(["x"], pa.large_string())})
    parquet(root / "2024" / "part-2.parquet", wide)
    (root / "_SUCCESS").write_text("")  # Spark's marker: Ray reads only *.parquet, so do we
    read, read_footer = [], dataset_source._read_footer
    monkeypatch.setattr(dataset_source, "_read_footer",
                        lambda fs, file: read.append(file) or read_footer(fs, file))  # fmt: skip
    source = TextSource(dataset=str(root), tokenizer="", text_column="body")
    assert check_text_dataset(source) is None  # no ConfigError: the run may start
    assert sorted(read) == [str(root / "2024" / "part-2.parquet"),
                            str(root / "part-0.parquet"), str(root / "part-1.parquet")]  # fmt: skip


# ------------------------------------------------------------------------------------------
# --help shows the profile's values


def help_text(capsys, *argv) -> str:
    from jobs.ddp.main import PROFILES  # noqa: PLC0415 - the real profiles

    with pytest.raises(SystemExit):
        parse_args("ddp", TrainConfig, PROFILES, argv=list(argv))
    return capsys.readouterr().out


def setting_line(text: str, name: str) -> str:
    return next(line.split()[0] for line in text.splitlines() if line.startswith(f"  {name}="))


def test_help_shows_the_smoke_profiles_values(capsys):
    text = help_text(capsys, "--help")
    assert "with the smoke profile's values" in text
    assert setting_line(text, "cpus_per_worker") == "cpus_per_worker=0.5"
    assert setting_line(text, "grad_accum") == "grad_accum=2"
    assert setting_line(text, "smoke_rows") == "smoke_rows=1000"


def test_help_with_the_full_profile_shows_its_values(capsys):
    text = help_text(capsys, "--profile", "full", "--help")
    assert setting_line(text, "cpus_per_worker") == "cpus_per_worker=8"
    assert setting_line(text, "model") == "model='gpt2'"


def test_help_puts_every_short_settings_meaning_in_one_column(capsys):
    settings = help_text(capsys, "--help").split("profile's values:\n", 1)[1].splitlines()
    short = [line for line in settings if len(line.split()[0]) < 28]
    columns = {re.match(r"  \S+ +", line).end() for line in short}
    assert len(short) > 30 and len(columns) == 1, columns


# ------------------------------------------------------------------------------------------
# strict JSON and the output filter


def test_non_finite_numbers_become_null_and_are_flagged():
    text = strict_json({"loss": float("nan"), "ok": 1.5, "nested": {"g": float("inf")}})
    assert json.loads(text) == {"loss": None, "ok": 1.5, "nested": {"g": None},
                                "nonfinite": ["loss", "nested.g"]}  # fmt: skip


# Lines as Ray 2.60 forwards them to the driver (a healthy run, then an injected failure).
def forwarded(*lines: tuple[str, str]) -> str:
    return "".join(f"\x1b[36m({source})\x1b[0m {message}\n" for source, message in lines)


CONTROLLER, RANK0, RANK1 = (
    "TrainController pid=8863",
    "RayTrainWorker pid=9071",
    "RayTrainWorker pid=9099",
)
HEALTHY = forwarded(
    (
        CONTROLLER,
        "[2026-12-03 18:10:02,225 E 8863 8960] core_worker.cc:2465: Actor with class "
        "name: 'PreemptionWatcher' and ID: '85b8' has constructor arguments in the "
        "object store and max_restarts > 0. If the arguments ... restart will fail.",
    ),
    (
        RANK0,
        "[W1203 18:10:02.841262543 socket.cpp:207] [c10d] The hostname of the client "
        "socket cannot be retrieved. err=-3",
    ),
    (
        "DatasetManager pid=9185",
        "/x/execution_options.py:436: RayDeprecationWarning: "
        "`ExecutionOptions.exclude_resources` is deprecated and will be "
        "removed after January 2027.",
    ),
    ("DatasetManager pid=9185", "  self.exclude_resources = exclude_resources"),
    (RANK0, "step  5/30 | epoch 0 | loss 5.5901"),
)
REPEATED = "\x1b[32m [repeated 3x across cluster]\x1b[0m"
FAILURE = forwarded(
    (RANK1, "FAULT INJECTION 1/1: rank 1 dies at step 13 after its update (fail_mode=exit)"),
    (RANK0, "Error in training function:"),
    (RANK0, "Traceback (most recent call last):"),
    (RANK0, '  File "/w/shared/loop.py", line 69, in global_mean'),
    (RANK0, "RuntimeError: Connection closed by peer [127.0.0.1]:30110."),
    (RANK0, ""),
    (CONTROLLER, "[FailurePolicy] RETRY"),
    (CONTROLLER, "  Source: worker group"),
    (CONTROLLER, "  Error count: 1 (max allowed: 2)"),
    (CONTROLLER, "Error: Training failed due to worker errors:"),
    (CONTROLLER, "[Rank 0 Error Snippet]:"),
    (CONTROLLER, ""),
    (CONTROLLER, "[Rank 1 Error Snippet]:"),
    (CONTROLLER, "ray.exceptions.ActorDiedError: The actor died unexpectedly."),
    (CONTROLLER, "Graceful shutdown of backend failed. This is expected if a worker crashed."),
    (CONTROLLER, "Traceback (most recent call last):" + REPEATED),
    (CONTROLLER, '  File "/w/loop.py", line 241, in train' + REPEATED),
    (CONTROLLER, "Started training worker group of size 2:"),
    ("RayTrainWorker pid=10370", "resumed from checkpoint at step 5 (epoch 0, 160 samples)"),
)


class Sink:
    def __init__(self):
        self.text = ""

    def write(self, text):
        self.text += text

    def flush(self):
        pass


def filtered(text: str) -> list[str]:
    sink = Sink()
    stream = FilteredStream(sink, OutputFilter(), "[traceback hidden; full text in LOGS]")
    stream.write(text)
    stream.flush()
    return [line.replace("\x1b[36m", "").replace("\x1b[0m", "") for line in sink.text.splitlines()]


def test_known_benign_lines_are_hidden_and_each_filter_names_its_upstream_message():
    assert filtered(HEALTHY) == ["(RayTrainWorker pid=9071) step  5/30 | epoch 0 | loss 5.5901"]
    assert all(len(b.upstream) > 40 for b in BENIGN)


def test_an_injected_failure_shows_one_short_block():
    assert filtered(FAILURE) == [
        "(RayTrainWorker pid=9099) FAULT INJECTION 1/1: rank 1 dies at step 13 after its update "
        "(fail_mode=exit)",
        "(RayTrainWorker pid=9071) [traceback hidden; full text in LOGS]",
        "(TrainController pid=8863) [FailurePolicy] RETRY",
        "(TrainController pid=8863)   Source: worker group",
        "(TrainController pid=8863)   Error count: 1 (max allowed: 2)",
        "(TrainController pid=8863) [traceback hidden; full text in LOGS]",
        "(TrainController pid=8863) Started training worker group of size 2:",
        "(RayTrainWorker pid=10370) resumed from checkpoint at step 5 (epoch 0, 160 samples)",
    ]


def test_the_drivers_own_lines_pass_unchanged():
    assert filtered("Traceback (most recent call last):\nerror: x\n") == [
        "Traceback (most recent call last):",
        "error: x",
    ]


def test_verbose_shows_what_the_filter_hides_and_prints_the_data_stats(tmp_path, capsys):
    import torch  # noqa: PLC0415

    from shared.observability.log_filter import filtered_output  # noqa: PLC0415
    from shared.observability.run_outputs import DATA_STATS_FILE, RankZeroOutputs  # noqa: PLC0415

    class RankZero:  # the two things RankZeroOutputs asks a session for
        rank, device = 0, torch.device("cpu")

        def data_stats(self) -> str:
            return "Operator 1 ReadParquet: 2 tasks executed, 4 blocks produced\n"

    for verbose in (False, True):
        cfg = start(tmp_path / str(verbose), verbose=verbose, tensorboard=False)
        with filtered_output(str(tmp_path / "logs"), enabled=not cfg.verbose):
            print(HEALTHY, end="", flush=True)
            RankZeroOutputs(cfg, None, RankZero())._data_stats(None)
        out = capsys.readouterr().out
        stats_file = os.path.join(cfg.run_dir, DATA_STATS_FILE)
        with open(stats_file) as f:
            assert f.read().startswith("Operator 1 ReadParquet")
        assert ("PreemptionWatcher" in out) is verbose
        assert ("Operator 1 ReadParquet" in out) is verbose
        assert (f"data pipeline stats: {stats_file}" in out) is not verbose


def test_the_readme_quotes_the_refusal_the_code_prints(tmp_path):
    from conftest import REPO

    trained(tmp_path)
    with pytest.raises(ConfigError) as err:
        check_resume(start(tmp_path, seq_len=32))
    assert f"`error: {err.value}`" in (REPO / "README.md").read_text()
