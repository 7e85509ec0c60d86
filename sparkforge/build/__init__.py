"""The build stage: a Plan becomes a build context, an image built by BuildKit, smoke-tested and tagged.

It owns the build context (render), `docker buildx build` (builder), every call of the docker CLI
(dockercli), the build record of an image (inspect), the recipe's prebuilt wheel (prebuilt), the wheel
cache (wheels) and its key (wheelkey), the smoke tiers (smoke), and the library entry of each build verb
(pipeline).

It may import recipe and the shared modules (errors, files, net, gitfetch, imageref, registry, inimage).
"""
