"""The test suite; a package so that the benches import its harness (tests.support)."""
