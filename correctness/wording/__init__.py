"""Levers' own words for a recipe's component_tests entry (`shape`, `detail`, `note`), one module per
lever that has them; a lever's spec names its function (`LeverSpec.entry_text`), and the catalogue
the module, so that `correctness attach` words an entry without importing a lever kind. They read
the record only, with the shared sentences of correctness.entries."""
