"""The fixture recipes the component tests run their levers at, and the one factory that builds a
tier's levers at several of them."""

from collections.abc import Callable, Sequence

from correctness.lever import Lever, LeverOptions, NotApplicable

GEMMA = "gemma-4-31b/h100/attune-tp2-pp4-split13"
NEMOTRON = "nemotron-3-super-120b-a12b/h200/attune-tp4-pp2-ep8-mt16k"
LLAMA = "llama-3.1-8b/h100/example-tp2-pp1-offload05"
QWEN3_MOE = "qwen3-30b-a3b/h100/example-tp2-ep4-offload07"
GPT_OSS = "gpt-oss-20b/h100/example-tp2-ep4-offload06"
MOONLIGHT = "moonlight-16b-a3b/h100/example-tp2-ep4-offload07"
SEEDS = (GEMMA, NEMOTRON)  # the two seed recipes


def at_recipes(tier: Callable[[str, LeverOptions], list[Lever]], recipes: Sequence[str] = SEEDS
               ) -> Callable[[LeverOptions], list[Lever]]:
    """A `levers` factory: the tier's levers at each recipe (with --recipe, each recipe id stands
    for the user's recipe and the plugin keeps one lever of a kind). A recipe the tier does not
    apply to is left out; NotApplicable, with every reason, only where it applies to none."""

    def factory(options: LeverOptions) -> list[Lever]:
        levers, reasons = [], []
        for recipe in recipes:
            try:
                levers += tier(recipe, options)
            except NotApplicable as reason:
                reasons.append(str(reason))
        if not levers:
            raise NotApplicable("; ".join(dict.fromkeys(reasons)))
        return levers

    return factory
