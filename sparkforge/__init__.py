"""sparkforge: reproducible vLLM images for DGX Spark (GB10) clusters.

The packages are the stages of the pipeline, and imports go only down it:
__main__ (the console script) -> cli -> repro -> distribute -> build -> recipe -> the shared modules here (errors, files, net, gitfetch, imageref, registry)
and the image side (inimage, whose proc is the one way every stage starts a process). tests/unit/test_layout.py holds the package to that order.
"""

__version__ = "0.1.0"
