"""The recipe stage: from YAML recipes and mod folders to a frozen, resolved Plan.

It owns the shape of a recipe and of mod.yaml (fields: field types; schema: models), reading them (config,
the only YAML reader), the Plan and its tag (plan), making it from a recipe chain (planner), where the
project's inputs live (layout), lock files (lockfile) and a recipe against its lock (lock), pins asked from registries and
git remotes (resolve), real sources and release lists (sources), files pinned by URL and sha256
(download), patches named by URL (remote) and vLLM's arch list (archlist). It never touches Docker.

It may import only the shared modules (errors, files, net, gitfetch, imageref, registry) and inimage.
"""
