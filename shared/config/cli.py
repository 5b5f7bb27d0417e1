"""``key=value`` command lines: defaults <- profile <- overrides, parsed to each field's type,
validated, and every problem reported as one sentence (exit 2) before Ray starts."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
import time
import types
import typing
from typing import Any

from shared.config.base import BaseConfig, ConfigError


def user_fields(cls: type) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls) if not f.metadata.get("internal")}


def _parse_value(name: str, text: str, annotation: Any) -> Any:
    if annotation is bool:
        lowered = text.lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"{name} must be true or false (got '{text}').")
    if annotation in (int, float):
        try:
            return annotation(text)
        except ValueError:
            noun = "an integer" if annotation is int else "a number"
            raise ConfigError(f"{name} must be {noun} (got '{text}').") from None
    if annotation is str:
        return text
    if isinstance(annotation, types.UnionType):  # e.g. `int | None`
        if text.lower() in ("none", "null", ""):
            return None
        (inner,) = [a for a in typing.get_args(annotation) if a is not type(None)]
        return _parse_value(name, text, inner)
    raise TypeError(f"unsupported config type {annotation!r} for {name}")


def apply_overrides(cfg: BaseConfig, overrides: dict[str, str]) -> BaseConfig:
    """Return a copy of ``cfg`` with string overrides parsed to each field's type."""
    fields = user_fields(type(cfg))
    hints = typing.get_type_hints(type(cfg))
    values = {}
    for name, text in overrides.items():
        if name not in fields:
            raise ConfigError(
                f"unknown setting '{name}'; valid settings: {', '.join(sorted(fields))}."
            )
        values[name] = _parse_value(name, text, hints[name])
    return dataclasses.replace(cfg, **values)


def split_overrides(args: list[str]) -> dict[str, str]:
    overrides = {}
    for arg in args:
        key, sep, value = arg.partition("=")
        if not sep or not key:
            raise ConfigError(f"expected key=value, got '{arg}'.")
        overrides[key.strip()] = value.strip()
    return overrides


def build_config(
    cls: type, profiles: dict[str, dict[str, Any]], profile: str, overrides: dict[str, str]
) -> Any:
    """Defaults <- profile <- command-line overrides, then validation."""
    if profile not in profiles:
        raise ConfigError(f"unknown profile '{profile}'; valid profiles: {', '.join(profiles)}.")
    cfg = cls(**profiles[profile])
    cfg = apply_overrides(cfg, overrides)
    cfg.profile = profile
    cfg.validate()
    if not cfg.run_name:
        cfg.run_name = default_run_name(profile)
    if "://" not in cfg.storage_path:  # workers run in another cwd: hand them absolute paths
        cfg.storage_path = os.path.abspath(cfg.storage_path)
    else:  # "$BUCKET_URI/runs" with a URI ending in "/" must not create an empty path segment
        scheme, rest = cfg.storage_path.split("://", 1)
        rest = re.sub("/{2,}", "/", rest)  # file:///mnt keeps its one leading "/"
        cfg.storage_path = f"{scheme}://{rest.rstrip('/') or '/'}"
    return cfg


def default_run_name(profile: str) -> str:
    """A fresh run each time, unless this is a retry of the same Anyscale job: its id is the
    same for every attempt, so a retried job resumes from its own checkpoints."""
    job_id = os.environ.get("ANYSCALE_PRODJOB_ID")
    return f"{profile}-{job_id}" if job_id else f"{profile}-{time.strftime('%Y%m%d-%H%M%S')}"


def describe(cls: type, profile: dict[str, Any] | None = None) -> str:
    """One line per setting with its value in ``profile`` (else the default) and its help."""
    profile = profile or {}
    fields = user_fields(cls)
    settings = {name: f"{name}={profile.get(name, f.default)!r}" for name, f in fields.items()}
    # One column for the help text; a setting too long for it (a hub path) just pushes it right.
    width = min(max(map(len, settings.values())), 30)
    return "\n".join(
        f"  {settings[name]:<{width}}  {f.metadata.get('help', '')}" for name, f in fields.items()
    )


def parse_args(
    job: str,
    cls: type,
    profiles: dict[str, dict[str, Any]],
    argv: list[str] | None = None,
    description: str = "",
) -> Any:
    """Parse ``[--profile P] key=value ...``; on bad input print one line and exit 2."""
    # --help lists the values of the profile it runs with (--profile full --help: full's).
    chosen, _ = _profile_parser(add_help=False).parse_known_args(argv)
    profile = chosen.profile if chosen.profile in profiles else "smoke"
    parser = argparse.ArgumentParser(
        prog=f"jobs/{job}/main.py",
        description=description,
        epilog=f"settings (key=value), with the {profile} profile's values:\n"
        + describe(cls, profiles.get(profile)),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        parents=[_profile_parser(add_help=False)],
    )
    parser.add_argument(
        "--print-config",
        action="store_true",
        help="print the resolved settings as JSON and exit (deployment tooling reads this)",
    )
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    args = parser.parse_args(argv)
    try:
        cfg = build_config(cls, profiles, args.profile, split_overrides(args.overrides))
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    cfg.job = job
    cfg.driver_start_time = time.time()
    if args.print_config:
        print(json.dumps({"job": job, "profile": cfg.profile, **resolved_settings(cfg)}))
        raise SystemExit(0)
    return cfg


def _profile_parser(add_help: bool) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(add_help=add_help)
    parser.add_argument("--profile", default="smoke", help="smoke (default) or full")
    return parser


def resolved_settings(cfg: BaseConfig) -> dict[str, Any]:
    """Every user-facing setting's value after profile and overrides."""
    return {name: getattr(cfg, name) for name in user_fields(type(cfg))}
