"""The test suite: tiers by marker (README, "Tests"; docs/tests.md); shared helpers live in tests.support."""
