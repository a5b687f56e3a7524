"""The pre-flight of the hardware's rules: a GPU-free check of a kernel build's PTX and
of what the DSL recorded while compiling it (``bench/notes/2026-12-05-preflight.md``).

It reads text and recorded facts only, never the kernel classes, so a build is judged
by what it compiled to.  The public entry points:

- :func:`check` ``(build, ptx, facts) -> [Violation]``: every rule on one build;
- :func:`recording`: a context that records a compile's facts (:class:`BuildFacts`:
  the TMA maps, shared memory, the cubin's registers) while the DSL compiles;
- :func:`collect`: the compiled PTX (and the cubin's facts) from the DSL's dump folder.

Modules: ``ptx`` (the PTX reader), ``trace`` (the facts), ``uniform`` (values per
thread and control dependence), ``warps`` (which warps reach an instruction),
``rules`` (the rules).
"""

from .rules import RULES, Violation, check
from .trace import BuildFacts, TmaMap, collect, recording

__all__ = ["RULES", "BuildFacts", "TmaMap", "Violation", "check", "collect", "recording"]
