"""Pure, fast unit tests: no broker, no network."""
