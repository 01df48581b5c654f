"""grpo-units-plugin: a unit-aware answer reward (`unit_match`) and a CSV source of word problems with
units (`units_csv`) for grpo-pipeline, registered as entry points (see pyproject.toml)."""
