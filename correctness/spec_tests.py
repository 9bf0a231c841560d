"""Component tests generated from lever specs (correctness.lever_spec): `globals().update(component_tests(specs))`
in a test module gives it one test per TierTest, marked `levers` for the plugin to parametrise."""

from collections.abc import Callable, Iterable

import pytest

from correctness.lever_spec import LeverSpec, TierTest
from correctness.recipe_sets import at_recipes


def _component_test(test: TierTest, levers: tuple[str, ...]) -> Callable:
    def component_test(lever, case, lever_check):
        lever_check(lever, case)

    component_test.__name__ = component_test.__qualname__ = test.test
    component_test.__doc__ = test.doc or None
    marked = pytest.mark.levers(factory=at_recipes(test.factory, test.recipes),
                                lever=levers[0] if len(levers) == 1 else levers)
    return marked(component_test)


def component_tests(specs: Iterable[LeverSpec]) -> dict[str, Callable]:
    """The component tests of the specs, by name, for a test module's globals: one per TierTest, marked
    `levers` with every spec that names it (two levers one factory builds share their tests)."""
    levers: dict[int, tuple[TierTest, tuple[str, ...]]] = {}
    for spec in specs:
        for test in spec.tests:
            found, names = levers.get(id(test), (test, ()))
            levers[id(test)] = (found, (*names, spec.name))
    tests: dict[str, Callable] = {}
    for test, names in levers.values():
        if test.test in tests:
            raise ValueError(f"two component tests are named {test.test}")
        tests[test.test] = _component_test(test, names)
    return tests
