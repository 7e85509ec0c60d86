"""The image side of sparkforge: the one mod applier and the in-image checks, stdlib only.

Render copies this folder into every image as /opt/sparkforge/inimage (run as `python3 -I -B
/opt/sparkforge/inimage COMMAND ...`); the host imports it as `sparkforge.inimage`. Its modules import each
other relatively, so the folder works under either name.
"""

from .apply import apply_mod, check_static, verify_mod
from .contract import CheckState, ModState, Result
from .diff import FilePatch, parse_diff
from .patcher import PATCHER_TIMEOUT
from .paths import ModFailure
from .record import version_file_commit

__all__ = ["PATCHER_TIMEOUT", "CheckState", "FilePatch", "ModFailure", "ModState", "Result", "apply_mod",
           "check_static", "parse_diff", "verify_mod", "version_file_commit"]
