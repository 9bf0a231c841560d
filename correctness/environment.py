"""Environment variables set for the length of a block and restored after it (unset ones unset again)."""

import contextlib
import os
from collections.abc import Iterator, Mapping


@contextlib.contextmanager
def environment_set(values: Mapping[str, str]) -> Iterator[None]:
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
