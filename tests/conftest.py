"""Hypothesis profiles. Locally tests explore new random examples on every run (and replay the
failures kept in .hypothesis/); CI sets HYPOTHESIS_PROFILE=ci, which derandomizes the search so a
landing is judged on the same examples every time (exploration happens in development runs)."""

import os

from hypothesis import settings

settings.register_profile("ci", derandomize=True, database=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))
