"""Environment variables and attributes set for the length of a block and restored after it (unset
ones unset again, inherited ones inherited again)."""

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


@contextlib.contextmanager
def attribute_replaced(owner: object, name: str, value: object) -> Iterator[None]:
    """`owner.name` is `value` inside; outside it is as it was (inherited again where it was)."""
    own = name in vars(owner)
    saved = vars(owner)[name] if own else None
    setattr(owner, name, value)
    try:
        yield
    finally:
        if own:
            setattr(owner, name, saved)
        else:
            delattr(owner, name)


@contextlib.contextmanager
def attributes_replaced(owner: object, values: Mapping[str, object]) -> Iterator[None]:
    """attribute_replaced for each of `values` (name -> value)."""
    with contextlib.ExitStack() as stack:
        for name, value in values.items():
            stack.enter_context(attribute_replaced(owner, name, value))
        yield
