"""Tests of the unit tier."""
