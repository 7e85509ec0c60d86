"""The test suite: tiers by marker (README, "Tests"); shared helpers live in tests.support."""
