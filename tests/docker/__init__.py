"""Tests of the docker tier."""
