"""Guards built from a finished capture: the module trees and hook dicts of the
modules the trace went through (`guard_builder`), and the values the capture could
read (`state_guards`).  The checks themselves are C (guards/value_guards.c); see
docs/design.md, "Guards".
"""
