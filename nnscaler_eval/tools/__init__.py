"""For people, not for the hit path: `explain()` (what was captured, guarded and
why a frame fell back) and the demo `make demo` runs.
"""
