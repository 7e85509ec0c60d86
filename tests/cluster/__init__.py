"""Tests of the cluster tier."""
