"""The scratch folders of a build's kept PTX and cubin: paths the DSL can be told about.

The DSL takes the folder in its options string (``--dump-dir``), which it splits as a
shell would (``shlex``), or from ``CUTE_DSL_DUMP_DIR``, and writes it into its MLIR pass
pipeline between single quotes, where a quote or a newline breaks every build with an
error that names neither the folder nor ``TMPDIR``.  So the folder is made in the
temporary directory (``TMPDIR``) where its path is plain (:data:`PLAIN`: letters,
digits, spaces and ``_./+=,@%~:-``), else in the first plain one of :data:`FALLBACKS`
that can be written (the folder lives for one build), and it is quoted in the options
(:func:`dump_options`); with none, the error names ``TMPDIR``.
"""

import os
import re
import shlex
import tempfile

PLAIN = re.compile(r"[\w ./+=,@%~:-]*", re.ASCII)
FALLBACKS = ("/tmp", "/var/tmp")


def root() -> str:
    """Where scratch folders are made: the temporary directory, where its path is plain."""
    first = tempfile.gettempdir()
    for candidate in (first, *FALLBACKS):
        if PLAIN.fullmatch(candidate) and os.access(candidate, os.W_OK | os.X_OK):
            return candidate
    raise RuntimeError(
        f"the temporary directory {first!r} (TMPDIR) holds characters the DSL cannot take in "
        f"the path of a build's scratch folder, and none of {', '.join(FALLBACKS)} can be "
        f"written: set TMPDIR to a directory whose path has only letters, digits, spaces "
        f"and _./+=,@%~:-")


def directory(prefix: str) -> tempfile.TemporaryDirectory:
    """A fresh scratch folder (removed on leaving the ``with``) in :func:`root`."""
    return tempfile.TemporaryDirectory(prefix=prefix, dir=root())


def dump_options(folder: str) -> str:
    """The DSL's options that keep a build's PTX and cubin in ``folder``, quoted."""
    return f" --keep-ptx --keep-cubin --dump-dir {shlex.quote(folder)}"
