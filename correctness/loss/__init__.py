"""Loss-side levers."""
