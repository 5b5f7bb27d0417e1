"""``python -m shared.export --job JOB --run RUN [--step N] [--dest DIR] [--storage-path P]``."""

from __future__ import annotations

import argparse
import sys

from shared import storage
from shared.checkpoint import CheckpointInvalid
from shared.export import ExportError, export_run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m shared.export",
        description="Export a run's checkpoint as a Hugging Face model directory "
        "(config.json, model.safetensors, tokenizer files).",
    )
    parser.add_argument("--job", required=True, help="the job that trained the run (ddp, ...)")
    parser.add_argument("--run", required=True, help="the run_name")
    parser.add_argument("--storage-path", default="runs", help="the run's storage_path")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step; default newest")
    parser.add_argument("--dest", default=None, help="default <run_dir>/export/step_<N>")
    args = parser.parse_args(argv)
    run_dir = storage.join(args.storage_path, args.job, args.run)
    try:
        dest = export_run(run_dir, args.step, args.dest)
    except (ExportError, CheckpointInvalid) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"exported {run_dir} to {dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
