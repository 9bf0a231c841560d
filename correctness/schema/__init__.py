"""The JSON schemas of the files the suite reads (recipe.schema.json, record.schema.json), and the
one way they are applied: `first_problem` gives the most relevant violation as a field path and a
message of one short line (jsonschema's own messages quote the whole offending value, which for a
record's `cases` can be megabytes). jsonschema is imported only when a document is checked."""

import datetime
import json
from functools import cache
from importlib import resources
from typing import Any

BRIEF = 60  # characters of an offending value quoted in a message


@cache
def schema(name: str) -> dict[str, Any]:
    return json.loads(resources.files(__name__).joinpath(name).read_text(encoding="utf-8"))


def _date_time(value: object) -> bool:
    """ISO 8601 with a time zone (jsonschema checks date-time only with an optional package)."""
    return not isinstance(value, str) or datetime.datetime.fromisoformat(value).tzinfo is not None


@cache
def _validator(name: str):
    import jsonschema

    checker = jsonschema.FormatChecker()
    checker.checks("date-time", raises=ValueError)(_date_time)
    return jsonschema.Draft202012Validator(schema(name), format_checker=checker)


def _brief(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= BRIEF else text[: BRIEF - 3] + "..."


def _message(error) -> tuple[list[Any], str]:
    """(path, message) of one violation, the path naming a missing field itself."""
    path = list(error.absolute_path)
    if error.validator == "required" and isinstance(error.instance, dict):
        missing = next(key for key in error.validator_value if key not in error.instance)
        return path + [missing], "missing (a required field)"
    if error.validator == "type":
        expected = error.validator_value if isinstance(error.validator_value, list) else [error.validator_value]
        return path, f"{_brief(error.instance)} is not of type {', '.join(map(repr, expected))}"
    if error.validator == "format":
        return path, f"{_brief(error.instance)} is not a valid {error.validator_value}"
    if error.validator in ("enum", "const"):
        return path, f"{_brief(error.instance)} is not one of {_brief(error.validator_value)}"
    first_line = error.message.splitlines()[0] if error.message else error.validator
    return path, first_line if len(first_line) <= 200 else first_line[:197] + "..."


def first_problem(name: str, document: Any) -> tuple[str, str] | None:
    """The most relevant violation of schema `name` by `document`, as (dotted field path or
    "(top level)", one-line message); None where it fits."""
    import jsonschema

    error = jsonschema.exceptions.best_match(_validator(name).iter_errors(document))
    if error is None:
        return None
    path, message = _message(error)
    return ".".join(str(part) for part in path) or "(top level)", message
