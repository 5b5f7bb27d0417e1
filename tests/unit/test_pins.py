"""One version set: the pins in pyproject.toml and constraints.txt are exact and identical."""

import re
import tomllib

from conftest import REPO


def _name(requirement: str) -> str:
    return re.split(r"[\[=<>!~ ]", requirement, maxsplit=1)[0].lower()


def pyproject_pins() -> dict[str, str]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    requirements = list(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        requirements += extra
    pins = {}
    for req in requirements:
        assert "==" in req and not re.search(r"[<>~!]", req), f"not an exact pin: {req}"
        pins[_name(req)] = req.split("==")[1]
    return pins


def constraint_pins() -> dict[str, str]:
    pins = {}
    for line in (REPO / "constraints.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            assert "==" in line, f"not an exact pin: {line}"
            name, version = line.split("==")
            pins[name.lower()] = version
    return pins


def test_pins_are_exact_and_identical():
    assert pyproject_pins() == constraint_pins()


def test_the_stack_the_issue_names_is_pinned():
    pins = pyproject_pins()
    assert pins["torch"] == "2.13.0"
    assert pins["ray"] == "2.60.0"
    for name in ("transformers", "deepspeed", "anyscale", "pyarrow", "pre-commit", "pytest"):
        assert name in pins


def test_installed_versions_match_the_pins():
    from importlib.metadata import version

    for name, pinned in pyproject_pins().items():
        assert version(name).split("+")[0] == pinned, name


def test_image_requirements_match_the_pins():
    pins = pyproject_pins()
    for line in (REPO / "images" / "requirements.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, version = line.split("==")
            assert pins[name.lower()] == version, line
