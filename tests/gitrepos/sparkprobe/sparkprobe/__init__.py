"""A small package that the git-source test image installs from its git component."""

VERSION = "1.0.0"
