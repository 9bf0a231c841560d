"""The attention lever kind: inputs, the paths under test, the reference adapter, the lever."""
