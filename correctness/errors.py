"""The suite's exceptions. Each carries a one-line message that names the thing at fault."""


class CorrectnessError(Exception):
    """Base class: bad input or an inconsistent declaration, reported in one line."""


class RecipeError(CorrectnessError):
    """A recipe or model-facts file is missing, malformed, or lacks a field the suite needs."""


class ShapeError(CorrectnessError):
    """A shape cannot be derived from the recipe and model facts at the requested scale."""


class OverMemory(ShapeError):
    """A CPU lever's case is estimated to need more memory than this machine has available: the
    lever is refused when it is built (correctness.memory). At the smoke scale the run stops there;
    at the recipe scale (--scale recipe) the lever's test skips with this line, and so the lever is
    incomplete here."""


class ComparisonError(CorrectnessError):
    """Outputs cannot be compared: a tensor is missing, or shapes or dtypes differ between paths."""


class CaseInputError(CorrectnessError):
    """A case's inputs (for example a captured checkpoint file) are missing or do not fit its shape."""


class ImplementationUnavailable(CorrectnessError):
    """A path cannot run on this machine or on this case (a backend refuses it); the case is skipped."""


def require_megatron_core() -> None:
    """Refuse (ImplementationUnavailable) where megatron-core does not import: missing, or failing to import."""
    try:
        import megatron.core  # noqa: F401
    except Exception as error:  # noqa: BLE001 - any import failure makes the path unavailable
        raise ImplementationUnavailable(f"megatron-core is not usable here: {type(error).__name__}: {error}") from None
