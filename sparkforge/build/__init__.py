"""The build stage: a Plan becomes a build context, an image built by BuildKit, smoke-tested and tagged.

It owns every call of the docker CLI (dockercli), and may import recipe and the shared modules.
"""
